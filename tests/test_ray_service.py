"""The service and its extra workers as Ray actors, on a local Ray cluster (``ray.init(num_cpus=2)``):
a worker actor killed mid-epoch is restarted by Ray, and every sample arrives exactly once."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
from test_service import assert_exactly_once, close_all, make_index_plan, make_shards

from entrain_data.client import EntrainLoader
from entrain_data.metadata import read_index

ray = pytest.importorskip("ray", reason="pip install entrain-data[ray]")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def local_ray():
    # loopback only: Ray binds its processes to the node address unless told otherwise. Its
    # session (logs, the object store's socket) goes to a private directory removed after the
    # test: Ray's default /tmp/ray keeps every session's socket file. A short path: the socket's
    # path must fit the OS's limit of ~107 bytes.
    temp = tempfile.mkdtemp(prefix="ray-")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp,
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _remotes(loader) -> list[dict]:
    return [w for w in loader.stats()["workers"] if w["remote"]]


def _pid_once_back(actor, wait: float = 60.0) -> int:
    """The actor's pid once Ray has restarted it (it answers 'restarting' until then)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return ray.get(actor.pid.remote(), timeout=wait)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_worker_actors_killed_mid_epoch_lose_nothing(tmp_path, local_ray):
    from entrain_data.workers.ray_service import start_on_ray

    index = make_shards(tmp_path)
    plan = make_index_plan().save(tmp_path / "plan.json")
    svc = start_on_ray(
        index=str(index), plan=str(plan), workers=2, local_workers=1, remote_timeout=3.0, window=2
    )
    loaders = []
    try:
        loaders = [
            EntrainLoader(
                svc.endpoint, r, prefetch=1, timeout=120, curve_server_key=svc.curve_public_key
            )
            for r in (0, 1)
        ]
        deadline = time.monotonic() + 120
        while len(_remotes(loaders[0])) < 2:
            assert time.monotonic() < deadline, "worker actors did not join"
            time.sleep(0.5)
        its = [iter(ld) for ld in loaders]
        out = {0: [next(its[0])], 1: [next(its[1])]}
        before = ray.get(svc.workers[0].pid.remote())
        ray.kill(svc.workers[0], no_restart=False)  # SIGKILL; Ray restarts the actor
        for r in (0, 1):
            out[r].extend(its[r])
        assert_exactly_once(out, list(read_index(index).keys))
        assert _pid_once_back(svc.workers[0]) != before  # restarted by Ray
        close_all(loaders)
        assert svc.wait(60) == "done"  # the service ends with the job
    finally:
        close_all(loaders)
        svc.close()
