"""A service's ipc folder is held by its coordinator from the moment the coordinator exists.

The coordinator used to take its own hold only once its interpreter ran: a process that
started a service and was killed with SIGKILL right after ``start_service`` returned left the
folder held by nobody, and the next service's sweep removed a live service's sockets."""

from __future__ import annotations

import contextlib
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

from entrain_data.owned_dirs import remove_orphaned_dirs

pytestmark = pytest.mark.timeout(120)

_STARTER = """
import os, signal
from entrain_data.workers.service import start_service
if __name__ == "__main__":
    svc = start_service(index={index!r}, plan={plan!r}, workers=1)
    print(svc.config.own_dir, svc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the instant start_service returns
"""


@pytest.fixture
def short_tmp():
    """A temp dir short enough for socket paths, so the service makes its folder there."""
    d = Path(tempfile.mkdtemp(prefix="eh-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Running (an orphan's zombie, not yet reaped by whoever adopted it, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_service_whose_starter_is_sigkilled_keeps_its_folder(tmp_path, short_tmp):
    index = make_shards(tmp_path, per_shard=8)
    plan = make_index_plan(dp=1).save(tmp_path / "plan.json")
    script = tmp_path / "starter.py"
    script.write_text(_STARTER.format(index=str(index), plan=str(plan)))
    starter = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(short_tmp)},
        start_new_session=True,  # its own group: whatever the test leaves is killed with it
    )
    try:
        own_dir, pid = starter.stdout.readline().split()
        assert starter.wait(30) == -signal.SIGKILL
        assert os.path.basename(own_dir).startswith(f"entrain-ipc-{starter.pid}-")
        # the next service's sweep, at once: the coordinator may not have run a line yet
        assert remove_orphaned_dirs(str(short_tmp), "entrain-ipc-") == []
        sock = os.path.join(own_dir, "service.sock")
        deadline = time.monotonic() + 60
        while not os.path.exists(sock) and _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(sock), "the service never bound its socket in its folder"
        os.kill(int(pid), signal.SIGTERM)  # drains, stops its worker, removes its folder
        deadline = time.monotonic() + 30
        while _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(int(pid))
        assert not os.path.exists(own_dir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(starter.pid, signal.SIGKILL)
        starter.wait(30)
