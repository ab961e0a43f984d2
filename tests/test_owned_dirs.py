"""Directories a process killed with SIGKILL leaves are removed by the next one that makes one.

A service's ipc folder and a rank's data-socket folder (``entrain-ipc-*``,
``entrain-rank-*`` in the temp dir) used to stay forever after an OOM kill or a
scheduler's SIGKILL; the shared-memory folders already did not."""

from __future__ import annotations

import fcntl
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
    (held / ".owner").touch()
    fd = os.open(held / ".owner", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    old = time.time() - 3600
    for d in (stale, locked, held):
        os.utime(d, (old, old))
    try:
        assert remove_orphaned_dirs(str(tmp_path), "entrain-rank-") == []  # another prefix
        assert remove_orphaned_dirs(str(tmp_path), "entrain-ipc-", pid=1) == []  # pid: named
        gone = remove_orphaned_dirs(str(tmp_path), "entrain-ipc-")
        assert sorted(gone) == sorted([str(stale), str(locked)])
        assert young.is_dir() and held.is_dir()
    finally:
        os.close(fd)
