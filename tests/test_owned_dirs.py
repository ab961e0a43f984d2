"""Directories a process killed with SIGKILL leaves are removed by the next one that makes one.

A service's ipc folder and a rank's data-socket folder (``entrain-ipc-*``,
``entrain-rank-*`` in the temp dir) used to stay forever after an OOM kill or a
scheduler's SIGKILL; the shared-memory folders already did not."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_service import make_index_plan, make_shards

from entrain_data.owned_dirs import (
    drop_owned_dir,
    hold_owned_dir,
    make_owned_dir,
    remove_orphaned_dirs,
)

pytestmark = pytest.mark.timeout(120)

_RANK = """
import sys
from entrain_data.client import EntrainLoader
if __name__ == "__main__":
    with EntrainLoader.local(rank=0, index={index!r}, plan={plan!r}, workers=1,
                             timeout=60) as loader:
        if not {hang}:
            print("served", sum(1 for _ in loader), flush=True)
        if {hang}:
            next(iter(loader))
            print("served", flush=True)
            sys.stdin.read()  # killed here, with its service, its worker and its rank socket
"""


def _entrain_dirs(tmp) -> list[str]:
    return sorted(p.name for p in tmp.glob("entrain-*"))


def _script(tmp_path, hang: bool) -> str:
    index = make_shards(tmp_path, per_shard=8)
    plan = make_index_plan(dp=1).save(tmp_path / "plan.json")
    path = tmp_path / f"rank_{int(hang)}.py"
    path.write_text(_RANK.format(index=str(index), plan=str(plan), hang=hang))
    return str(path)


@pytest.fixture
def short_tmp():
    """A temp dir short enough for socket paths (pytest's ``tmp_path`` is not: the service
    would make its folder in /tmp instead)."""
    d = Path(tempfile.mkdtemp(prefix="eo-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_what_a_sigkilled_service_and_rank_leave_the_next_service_removes(tmp_path, short_tmp):
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    killed = subprocess.Popen(
        [sys.executable, _script(tmp_path, hang=True)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: the service and workers die with it
    )
    try:
        assert killed.stdout.readline().startswith("served")
        left = _entrain_dirs(short_tmp)
        assert [d.split("-")[1] for d in left] == ["ipc", "rank"], left
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(30)
    assert _entrain_dirs(short_tmp) == left  # nothing could remove them: all were killed

    again = subprocess.run(
        [sys.executable, _script(tmp_path, hang=False)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert again.returncode == 0 and again.stdout.startswith("served"), again.stderr
    assert _entrain_dirs(short_tmp) == []  # the killed run's folders, and its own


def _maker(root, prefix: str) -> subprocess.Popen:
    """Another process that makes an owned directory, prints it, and holds it until its
    stdin closes."""
    code = (
        "import sys; from entrain_data.owned_dirs import make_owned_dir; "
        f"print(make_owned_dir({str(root)!r}, {prefix!r}), flush=True); sys.stdin.read()"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_a_directory_stays_while_any_process_holding_it_lives(tmp_path):
    """The coordinator holds its ipc folder too: the process that started it may end first
    (a script that started the service in a subprocess and exited)."""
    maker = _maker(tmp_path, "entrain-ipc-")
    path = maker.stdout.readline().strip()
    assert os.path.basename(path).startswith(f"entrain-ipc-{maker.pid}-")
    assert hold_owned_dir(path)  # as the coordinator does
    maker.stdin.close()
    maker.wait(30)
    assert remove_orphaned_dirs(str(tmp_path), "entrain-ipc-") == []  # still held here
    assert os.path.isdir(path)
    drop_owned_dir(path)
    assert os.listdir(tmp_path) == []


def test_only_unheld_directories_of_the_prefix_with_a_lock_file_are_removed(tmp_path):
    mine = make_owned_dir(str(tmp_path), "entrain-rank-")
    users = tmp_path / "entrain-rank-123-mine"  # a user's folder of the same pattern: no lock
    users.mkdir()
    other = tmp_path / "entrain-ipc-1-x"  # another prefix
    other.mkdir()
    (other / ".owner").touch()
    assert remove_orphaned_dirs(str(tmp_path), "entrain-rank-") == []
    assert remove_orphaned_dirs(str(tmp_path), "entrain-ipc-", pid=2) == []
    assert remove_orphaned_dirs(str(tmp_path), "entrain-ipc-", pid=1) == [str(other)]
    assert users.is_dir() and os.path.isdir(mine)
    drop_owned_dir(mine)
    assert not os.path.exists(mine) and not hold_owned_dir(mine)


def _aged(*dirs) -> None:
    """Last touched an hour ago: past every sweep's safety age."""
    old = time.time() - 3600
    for d in dirs:
        os.utime(d, (old, old))


def _held(folder) -> int:
    """A lock file in ``folder``, held (shared) as a live process holds its folder's."""
    (folder / ".owner").touch()
    fd = os.open(folder / ".owner", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def test_a_directory_half_made_by_a_killed_maker_goes_once_stale(tmp_path):
    """A maker killed between making its directory and naming it (``.new-...``: no pid, maybe
    no lock file) left it for good: no sweep looked at those names."""
    young = tmp_path / ".new-entrain-ipc-young"
    stale = tmp_path / ".new-entrain-ipc-stale"  # killed before its lock file
    locked = tmp_path / ".new-entrain-ipc-stalex"  # killed after: the lock file, unheld
    held = tmp_path / ".new-entrain-ipc-held"  # old, but a live process holds it
    for d in (young, stale, locked, held):
        d.mkdir()
    (locked / ".owner").touch()
    fd = _held(held)
    _aged(stale, locked, held)
    try:
        assert remove_orphaned_dirs(str(tmp_path), "entrain-rank-") == []  # another prefix
        assert remove_orphaned_dirs(str(tmp_path), "entrain-ipc-", pid=1) == []  # pid: named
        gone = remove_orphaned_dirs(str(tmp_path), "entrain-ipc-")
        assert sorted(gone) == sorted([str(stale), str(locked)])
        assert young.is_dir() and held.is_dir()
    finally:
        os.close(fd)


# A folder of ours left without its lock file: no sweep could judge it, so it stayed for good
# (an empty ``entrain-shm-*`` after a full test run). ``shutil.rmtree`` listed the folder,
# removed what it listed (the lock file too), and its final rmdir failed, silently, on a
# segment a worker wrote meanwhile (the coordinator drops its shared folder before it stops
# its workers); the worker unlinked that segment as it stopped.

_WRITER = """
import os, sys
made = []
for line in sys.stdin:
    if line.strip() == "write":  # a new segment, as a worker's SegmentPool makes one
        path = os.path.join(sys.argv[1], f"w-{len(made)}.seg")
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            print("gone", flush=True)  # the folder is gone: no segment
            continue
        made.append(path)
        print("wrote", flush=True)
    else:  # stopping: it unlinks its segments, as SegmentPool.close does
        for path in made:
            try:
                os.unlink(path)
            except OSError:
                pass
        print("closed", flush=True)
        break
"""


class _Writer:
    """Another process that writes a segment file into ``folder`` each time it is asked."""

    def __init__(self, folder: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, folder],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, what: str) -> str:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


def _segment_folder(root, made_here: bool) -> str:
    """A folder of ours holding a segment: made and held here, or one whose maker has ended
    (its lock file held by nobody)."""
    if made_here:
        folder = make_owned_dir(str(root), "entrain-shm-")
    else:
        folder = str(root / "entrain-shm-1-x")
        os.mkdir(folder)
        Path(folder, ".owner").touch()
    Path(folder, "w-old.seg").touch()
    return folder


@pytest.mark.parametrize("remover", ["drop", "sweep"])
def test_a_folder_a_process_writes_into_while_it_is_removed_leaves_nothing(
    tmp_path, monkeypatch, remover
):
    """The writer adds a segment right before each of the remover's first three ``rmdir``s
    (after it listed the folder): deterministic, and the worst timing a real one can hit."""
    folder = _segment_folder(tmp_path, made_here=remover == "drop")
    writer = _Writer(folder)
    real_rmdir = os.rmdir
    raced: list[str] = []

    def rmdir_raced(path, *args, **kwargs):
        if os.fspath(path) == folder and len(raced) < 3:
            raced.append(writer.ask("write"))
        return real_rmdir(path, *args, **kwargs)

    try:
        with monkeypatch.context() as m:
            m.setattr(os, "rmdir", rmdir_raced)
            if remover == "drop":
                drop_owned_dir(folder)
            else:
                assert remove_orphaned_dirs(str(tmp_path), "entrain-shm-") == [folder]
        assert raced and set(raced) == {"wrote"}
        assert writer.ask("close") == "closed"
        writer.proc.wait(30)
        assert os.listdir(tmp_path) == []  # before: the folder, empty, without its lock file
    finally:
        writer.proc.kill()
        writer.proc.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


def _die_at(step: int, remover: str, root: str) -> None:
    """In a forked child: remove the folder(s) in ``root``, killed with SIGKILL right before
    the ``step``-th unlink or rmdir; exits normally if the removal takes fewer steps."""
    try:
        path = _segment_folder(Path(root), made_here=True) if remover == "drop" else None
        for i in range(3):
            Path(path or os.path.join(root, "entrain-shm-1-x"), f"w-{i}.seg").touch()
        steps = itertools.count(1)

        def dying(real):
            def call(*args, **kwargs):
                if next(steps) == step:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)

            return call

        os.unlink, os.rmdir = dying(os.unlink), dying(os.rmdir)
        if path is not None:
            drop_owned_dir(path)
        else:
            remove_orphaned_dirs(root, "entrain-shm-")
    finally:
        os._exit(0)


@pytest.mark.parametrize("remover", ["drop", "sweep"])
def test_what_a_remover_killed_at_any_step_leaves_the_next_sweep_removes(tmp_path, remover):
    """Killed after unlinking the lock file (rmtree: in whatever order the folder lists) and
    before the rmdir, it left a folder no sweep judged. Now the lock file goes last, and a
    folder left empty without it goes once stale."""
    root = str(tmp_path)
    for step in range(1, 30):
        if remover == "sweep":
            _segment_folder(tmp_path, made_here=False)  # its maker has ended
        child = os.fork()
        if child == 0:
            _die_at(step, remover, root)  # never returns
        _, status = os.waitpid(child, 0)
        left = {p.name: sorted(os.listdir(p)) for p in tmp_path.iterdir()}
        _aged(*tmp_path.iterdir())  # swept as if looked at later: a leftover empty one is stale
        remove_orphaned_dirs(root, "entrain-shm-")
        assert os.listdir(tmp_path) == [], f"killed at step {step}, it left {left}"
        if os.WIFEXITED(status):
            break  # the removal ended before this step: every step was covered
    else:
        pytest.fail("the removal never ended")


def test_a_folder_left_empty_without_its_lock_file_goes_once_stale(tmp_path):
    """Only that: a young one may be a remover's between its last two steps; one with
    contents may be live where flock fails (or a user's); a held one is in use."""
    stale = tmp_path / "entrain-shm-3072-_u62z_62"  # as the slow test run left one
    young = tmp_path / "entrain-shm-3073-young"
    full = tmp_path / "entrain-shm-3074-full"
    held = tmp_path / "entrain-shm-3075-held"
    other = tmp_path / "entrain-ipc-3072-other"  # another prefix
    for d in (stale, young, full, held, other):
        d.mkdir()
    (full / "data.sock").touch()
    fd = _held(held)
    _aged(stale, full, held, other)
    try:
        assert remove_orphaned_dirs(str(tmp_path), "entrain-shm-", pid=3073) == []
        assert remove_orphaned_dirs(str(tmp_path), "entrain-shm-") == [str(stale)]
        assert young.is_dir() and full.is_dir() and held.is_dir() and other.is_dir()
        assert remove_orphaned_dirs(str(tmp_path), "entrain-ipc-", pid=3072) == [str(other)]
    finally:
        os.close(fd)
        for d in (young, full, held):
            shutil.rmtree(d, ignore_errors=True)


def test_a_folder_made_where_flock_fails_is_never_taken_for_a_leftover(tmp_path, monkeypatch):
    """It has no lock file while in use: it holds a mark instead, so it is never empty."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    with monkeypatch.context() as m:
        m.setattr(fcntl, "flock", no_locks)
        path = make_owned_dir(str(tmp_path), "entrain-shm-")
    try:
        assert ".owner" not in os.listdir(path)
        _aged(path)  # an idle service's: it made no segment for an hour
        assert remove_orphaned_dirs(str(tmp_path), "entrain-shm-") == []
        assert os.path.isdir(path)
    finally:
        drop_owned_dir(path)
    assert os.listdir(tmp_path) == []
