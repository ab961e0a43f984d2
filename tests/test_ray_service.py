"""The service and its extra workers as Ray actors, on a local Ray cluster (``ray.init(num_cpus=2)``):
a worker actor killed mid-epoch is restarted by Ray, and every sample arrives exactly once; a
service or worker that cannot start fails in the caller, typed (a bad ``host`` too); a picked port
another process takes before the service binds it is picked again; close() during another
thread's wait() still cleans up."""

from __future__ import annotations

import contextlib
import glob
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from test_service import assert_exactly_once, close_all, make_index_plan, make_shards

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput
from entrain_data.metadata import read_index

ray = pytest.importorskip("ray", reason="pip install entrain-data[ray]")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def local_ray():
    # loopback only: Ray binds its processes to the node address unless told otherwise. Its
    # session (logs, the object store's socket) goes to a private directory removed after the
    # module: Ray's default /tmp/ray keeps every session's socket file. A short path: the socket's
    # path must fit the OS's limit of ~107 bytes. One Ray for the module (its start is most of a
    # test's time); every test closes the actors it started.
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


def _data(tmp_path):
    return str(make_shards(tmp_path)), str(make_index_plan().save(tmp_path / "plan.json"))


def _shm_of(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/entrain-shm-{pid}-*")


def test_taken_port_raises_in_the_caller(tmp_path, local_ray):
    """The service could not bind: start_on_ray raises why, not a loader's timeout later."""
    from entrain_data.workers.ray_service import start_on_ray

    index, plan = _data(tmp_path)
    sockets = tmp_path / "s"  # made by the service, removed when it stops
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        svc = None
        try:
            with pytest.raises(InvalidInput, match="address already in use"):
                svc = start_on_ray(
                    index=index,
                    plan=plan,
                    workers=1,
                    endpoint=f"tcp://127.0.0.1:{port}",
                    socket_dir=str(sockets),
                )
        finally:
            if svc is not None:
                svc.close()
    assert not sockets.exists()


@contextlib.contextmanager
def _held_port() -> Iterator[int]:
    """A loopback port this test holds bound and listening: no one else can bind it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        yield busy.getsockname()[1]


def _picker(held: int, log: str, at: set[int] | None) -> Callable[[str], int]:
    """A stand-in for the service actor's port picker (Ray pickles this closure with the actor,
    so it runs there): pick ``i`` (0 the endpoint, 1 the remote endpoint, 2.. re-picks) returns
    ``held`` when ``i`` is in ``at`` (``None``: every pick), else a free port; each pick is
    appended to the file ``log``, which the test reads back."""
    calls: list[int] = []

    def pick(host: str) -> int:
        if at is None or len(calls) in at:
            port = held
        else:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        calls.append(port)
        with open(log, "a") as f:
            f.write(f"{port}\n")
        return port

    return pick


def _picks(log) -> list[int]:
    return [int(p) for p in log.read_text().split()] if log.exists() else []


@pytest.mark.parametrize("at", [0, 1], ids=["endpoint", "remote_endpoint"])
def test_picked_port_taken_before_the_bind_is_picked_again(tmp_path, local_ray, monkeypatch, at):
    """The race between picking a free port and binding it: lost once, the service still serves,
    on fresh ports."""
    from entrain_data.workers import ray_service

    index, plan = _data(tmp_path)
    log = tmp_path / "picks"
    with _held_port() as held:
        monkeypatch.setattr(ray_service, "_free_port", _picker(held, str(log), {at}))
        svc = None
        try:
            svc = ray_service.start_on_ray(index=index, plan=plan, workers=0, window=2)
            picks = _picks(log)
            assert len(picks) == 4 and picks[at] == held, f"picks in the service actor: {picks}"
            bound = [int(ep.rpartition(":")[2]) for ep in (svc.endpoint, svc.remote_endpoint)]
            assert bound == picks[2:] and held not in bound  # both picked again
            assert svc.wait(0) is None  # serving
        finally:
            if svc is not None:
                svc.close()


def test_picked_ports_taken_on_every_try_fail_typed(tmp_path, local_ray, monkeypatch):
    """Not an endless retry: after a few tries one typed error naming the host and the ports."""
    from entrain_data.workers import ray_service

    index, plan = _data(tmp_path)
    sockets = tmp_path / "s"
    log = tmp_path / "picks"
    with _held_port() as held:
        monkeypatch.setattr(ray_service, "_free_port", _picker(held, str(log), None))
        svc = None
        try:
            with pytest.raises(
                InvalidInput,
                match=rf"cannot serve on 127\.0\.0\.1: ports {held}(, {held})+ .*already in use",
            ) as raised:
                svc = ray_service.start_on_ray(
                    index=index, plan=plan, workers=0, window=2, socket_dir=str(sockets)
                )
        finally:
            if svc is not None:
                svc.close()
    tries = ray_service._PORT_TRIES
    assert str(raised.value).count(str(held)) == tries
    assert _picks(log) == [held] * (2 * tries)  # the endpoint and remote endpoint, each try
    assert not sockets.exists()


@pytest.mark.parametrize(
    "host", ["203.0.113.1", "no-such-host.invalid"], ids=["foreign", "unknown"]
)
def test_bad_host_raises_typed(tmp_path, local_ray, host):
    """An address not on the service's node (TEST-NET-3), or no address at all: ``InvalidInput``
    naming the host, not Ray's ``ActorDiedError``."""
    from entrain_data.workers.ray_service import start_on_ray

    with socket.socket() as s, contextlib.suppress(OSError):
        s.bind((host, 0))
        pytest.skip(f"{host} is an address of this host")
    index, plan = _data(tmp_path)
    svc = None
    try:
        with pytest.raises(InvalidInput, match=rf"host '{re.escape(host)}': .*cannot bind there"):
            svc = start_on_ray(index=index, plan=plan, workers=0, window=2, host=host)
    finally:
        if svc is not None:
            svc.close()


@pytest.mark.parametrize(
    ("option", "error", "match"),
    [({"window": 0}, InvalidInput, "window must be >= 1"), ({"windw": 2}, TypeError, "windw")],
)
def test_bad_option_raises_typed(tmp_path, local_ray, option, error, match):
    """Not Ray's ActorDiedError with the InvalidInput in its text: ``except InvalidInput`` works."""
    from entrain_data.workers.ray_service import start_on_ray

    index, plan = _data(tmp_path)
    svc = None
    try:
        with pytest.raises(error, match=match):
            svc = start_on_ray(index=index, plan=plan, workers=1, **option)
    finally:
        if svc is not None:
            svc.close()


@pytest.mark.slow
def test_worker_that_cannot_start_fails_start(tmp_path, local_ray, monkeypatch):
    """The plan missing on the workers' host (here: gone once the service read it; the service
    reads it once, the index again)."""
    from entrain_data.workers import ray_service

    index, plan = _data(tmp_path)
    serving = ray_service._serving

    def then_remove_plan(*args):
        endpoints = serving(*args)
        shutil.move(plan, tmp_path / "moved.json")
        return endpoints

    monkeypatch.setattr(ray_service, "_serving", then_remove_plan)
    svc = None
    try:
        with pytest.raises(InvalidInput, match=r"worker actor 0 on .*plan file not found"):
            svc = ray_service.start_on_ray(index=index, plan=plan, workers=1, window=2)
    finally:
        if svc is not None:
            svc.close()


@pytest.mark.slow
def test_worker_restarted_without_its_plan_is_reported(tmp_path, local_ray):
    """Ray restarts a killed worker; one whose restart cannot read the plan is not silent."""
    from entrain_data.workers.ray_service import start_on_ray

    index, plan = _data(tmp_path)
    svc = start_on_ray(index=index, plan=plan, workers=1, window=2)
    try:
        assert svc.wait(0) is None
        shutil.move(plan, tmp_path / "moved.json")
        ray.kill(svc.workers[0], no_restart=False)  # restarted by Ray: its init fails
        state = svc.wait(60)
        assert state is not None and "worker actor 0 on " in state, state
        assert "plan file not found" in state
    finally:
        svc.close()


@pytest.mark.slow
def test_close_while_another_thread_waits(tmp_path, local_ray):
    """close() is not queued behind a long wait() (then killed): the coordinator's clean-up runs."""
    from entrain_data.workers.ray_service import start_on_ray

    index, plan = _data(tmp_path)
    sockets = tmp_path / "s"
    svc = start_on_ray(index=index, plan=plan, workers=1, window=2, socket_dir=str(sockets))
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(svc.wait(90)), daemon=True)
    try:
        pid = ray.get(svc.service.pid.remote(), timeout=30)
        assert sockets.is_dir() and _shm_of(pid)
        waiter.start()
        time.sleep(1.0)  # the wait() is in the actor
        t0 = time.monotonic()
        svc.close()
        assert time.monotonic() - t0 < 20
        waiter.join(30)
        assert waited == ["stopped"]
        assert not sockets.exists() and not _shm_of(pid)
    finally:
        svc.close()
        waiter.join(30)
