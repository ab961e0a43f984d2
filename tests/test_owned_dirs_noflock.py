"""A temp dir without ``flock`` (Lustre mounted without ``-o flock``) still serves.

Starting a service there used to fail with a bare ``OSError: [Errno 37] No locks available``.
Now the folder is made without the lock file, with one warning naming it and why, and no
sweep ever removes it (nor any folder whose lock it cannot take)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from entrain_data.workers.service import start_service
from test_service import make_index_plan, make_shards

from entrain_data.owned_dirs import remove_orphaned_dirs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def short_tmp(monkeypatch):
    """The temp dir, short enough for socket paths, so the service makes its folder there."""
    d = Path(tempfile.mkdtemp(prefix="en-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _no_locks(fd: int, operation: int) -> None:
    """``flock`` on a filesystem that has none: what Lustre without ``-o flock`` answers."""
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_a_service_starts_where_flock_fails_and_no_sweep_removes_its_folder(
    tmp_path, short_tmp, monkeypatch, caplog
):
    index = make_shards(tmp_path, per_shard=8)
    plan = make_index_plan(dp=1).save(tmp_path / "plan.json")
    unknown = short_tmp / "entrain-ipc-1-x"  # another's folder: whose, flock cannot say
    unknown.mkdir()
    (unknown / ".owner").touch()
    svc = None
    try:
        with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
            m.setattr(fcntl, "flock", _no_locks)  # this process only: not the coordinator
            svc = start_service(index=str(index), plan=str(plan), workers=1)
            own_dir = svc.config.own_dir
            assert own_dir is not None and os.path.dirname(own_dir) == str(short_tmp)
            warned = [r.getMessage() for r in caplog.records if own_dir in r.getMessage()]
            assert len(warned) == 1 and "flock" in warned[0], caplog.text
            assert unknown.is_dir()  # the service's own sweep left it
            sock = os.path.join(own_dir, "service.sock")
            deadline = time.monotonic() + 60
            while not os.path.exists(sock) and svc.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert os.path.exists(sock), svc.failure()
            assert remove_orphaned_dirs(str(short_tmp), "entrain-ipc-") == []
        # a sweep from where flock works: the folder has no lock file, so it is not judged
        assert remove_orphaned_dirs(str(short_tmp), "entrain-ipc-", pid=os.getpid()) == []
        assert os.path.isdir(own_dir)
    finally:
        if svc is not None:
            svc.close()
    assert not os.path.exists(own_dir)  # removed at stop, as any service's
