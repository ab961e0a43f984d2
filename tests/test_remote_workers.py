"""Remote workers (issue 13 item 4, first half): ``entrain-data worker --connect`` joins a service
over tcp with CURVE, packs its tasks and sends each microbatch straight to its rank (the rank's
own tcp socket, CURVE with the rank's key), and a remote worker killed with SIGKILL mid-epoch
loses nothing (its tasks are re-issued once it falls silent). Loopback only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq
from _dist import free_port
from test_service import assert_exactly_once, close_all, make_index_plan, make_shards

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import read_index

pytestmark = pytest.mark.timeout(240)


def _worker(endpoint: str, index, plan, key: bytes, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "entrain_data.cli", "worker", "--connect", endpoint,
         "--index", str(index), "--plan", str(plan), f"--curve-server-key={key.decode()}", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _remotes(loader) -> list[dict]:
    return [w for w in loader.stats()["workers"] if w["remote"]]


def _said(procs: list[subprocess.Popen]) -> str:
    """What the worker processes printed (those that exited; the others are stopped first):
    a join that times out then says why."""
    out = []
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            text, _ = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append(f"worker {p.pid} (exit {p.returncode}):\n{text[-2000:]}")
    return "\n".join(out)


@pytest.mark.slow
def test_remote_workers_join_over_curve_and_a_killed_one_loses_nothing(tmp_path):
    from entrain_data.workers.service import start_service

    index = make_shards(tmp_path)
    plan = make_index_plan().save(tmp_path / "plan.json")
    pub, sec = zmq.curve_keypair()
    remote = f"tcp://127.0.0.1:{free_port()}"
    svc = start_service(
        index=index, plan=plan, workers=1, window=2, curve_public_key=pub, curve_secret_key=sec,
        remote_endpoint=remote, remote_timeout=3.0, socket_dir=str(tmp_path / "entrain-sock"),
    )  # fmt: skip
    procs = [_worker(remote, index, plan, pub) for _ in range(2)]
    loaders = [  # prefetch 4: the first burst of tasks overflows the local worker's capacity
        EntrainLoader(svc.endpoint, r, prefetch=4, timeout=90, curve_server_key=pub) for r in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 90
        while len(_remotes(loaders[0])) < 2:
            if time.monotonic() > deadline:
                pytest.fail(f"remote workers did not join:\n{_said(procs)}")
            time.sleep(0.3)
        its = [iter(ld) for ld in loaders]
        out = {0: [next(its[0])], 1: [next(its[1])]}
        # remote workers too send straight to the ranks (tcp + CURVE to each rank's socket)
        assert loaders[0].stats()["remote_direct_ranks"] == [0, 1]
        os.kill(procs[0].pid, signal.SIGKILL)  # a remote worker dies mid-epoch
        for r in (0, 1):
            out[r].extend(its[r])
        assert_exactly_once(out, list(read_index(index).keys))
        stats = loaders[0].stats()
        survivor = f"x{socket.gethostname()}-{procs[1].pid}"
        assert [w["tasks"] > 0 for w in stats["workers"] if w["remote"] == survivor] == [True]
        assert stats["direct_ranks"] == [0, 1]
        # nothing passed through the coordinator, unless the killed worker had reported a send
        # its socket never delivered: that rank's remote microbatches then take the hop
        assert stats["bytes_relayed"] == 0 or stats["remote_direct_ranks"] != [0, 1]
        close_all(loaders)
        assert svc.wait(30) == 0
        assert procs[1].wait(30) == 0  # stopped with the job
        assert "the service said stop" in procs[1].stdout.read()
    finally:
        close_all(loaders)
        svc.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.slow
def test_a_remote_worker_without_the_key_or_with_another_index_is_not_let_in(tmp_path):
    from entrain_data.workers.service import start_service

    index = make_shards(tmp_path)
    (tmp_path / "other").mkdir()
    other = make_shards(tmp_path / "other", per_shard=20)
    plan = make_index_plan().save(tmp_path / "plan.json")
    pub, sec = zmq.curve_keypair()
    wrong_pub, _ = zmq.curve_keypair()
    remote = f"tcp://127.0.0.1:{free_port()}"
    svc = start_service(
        index=index, plan=plan, workers=1, curve_public_key=pub, curve_secret_key=sec,
        remote_endpoint=remote, socket_dir=str(tmp_path / "entrain-sock"),
    )  # fmt: skip
    procs = [_worker(remote, index, plan, wrong_pub), _worker(remote, other, plan, pub)]
    ld = EntrainLoader(svc.endpoint, 0, timeout=90, curve_server_key=pub)
    try:
        for p in procs:  # both told why, exit 2: a join that hung or exited 0 said nothing
            assert p.wait(150) == 2, p.stdout.read()
        said = [p.stdout.read() for p in procs]
        assert "refused the encryption handshake: is --curve-server-key" in said[0]
        assert "the service refused it: its index" in said[1]
        assert _remotes(ld) == []  # nobody joined
        ld.close()
        with pytest.raises(InvalidInput, match="refused the encryption handshake"):
            EntrainLoader(svc.endpoint, 0, timeout=60, curve_server_key=wrong_pub).info  # noqa: B018
    finally:
        ld.close()
        svc.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.slow
def test_a_remote_worker_silent_for_a_while_rejoins_and_one_whose_service_died_exits(tmp_path):
    """A worker dropped as silent (a long task, a network blip) was never taken back though it
    kept sending heartbeats; a worker whose service was SIGKILLed ran on forever, silently."""
    from entrain_data.workers.service import start_service

    index = make_shards(tmp_path)
    plan = make_index_plan().save(tmp_path / "plan.json")
    pub, sec = zmq.curve_keypair()
    remote = f"tcp://127.0.0.1:{free_port()}"
    svc = start_service(
        index=index, plan=plan, workers=1, curve_public_key=pub, curve_secret_key=sec,
        remote_endpoint=remote, remote_timeout=2.0, socket_dir=str(tmp_path / "entrain-sock"),
    )  # fmt: skip
    proc = _worker(remote, index, plan, pub)
    ld = EntrainLoader(svc.endpoint, 0, timeout=90, curve_server_key=pub)
    try:
        _wait_for(lambda: len(_remotes(ld)) == 1, proc)
        os.kill(proc.pid, signal.SIGSTOP)  # silent past remote_timeout: dropped
        _wait_for(lambda: not _remotes(ld), proc)
        os.kill(proc.pid, signal.SIGCONT)
        _wait_for(lambda: len(_remotes(ld)) == 1, proc)  # it speaks again: back
        ld.close()
        os.kill(svc.pid, signal.SIGKILL)
        assert proc.wait(60) == 2  # twice remote_timeout without an answer
        assert "no word from the service for 4s" in proc.stdout.read()
    finally:
        ld.close()
        svc.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _wait_for(condition, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting:\n{_said([proc])}")
        time.sleep(0.2)


class _SlowSource:
    """A remote worker's source whose one microbatch takes ``seconds`` (longer than the
    service's silence by default) and then fails."""

    def __init__(self, seconds: float = 2.5) -> None:
        self.seconds = seconds

    def identity(self) -> str:
        return "slow"

    def make_packer(self):
        def pack(encoder_rows, llm_rows):
            time.sleep(self.seconds)
            raise SampleError("slow and broken", source="s.tar", key="k")

        return pack


_TASK = {"task": 1, "epoch": 0, "iteration": 0, "microbatch": 0, "replica": 0,
         "encoder_rows": [0], "llm_rows": [0]}  # fmt: skip


@pytest.mark.parametrize("answers", [True, False])
def test_a_worker_busy_from_its_first_task_still_stops_when_its_service_dies(answers, monkeypatch):
    """A worker learned the silence rule only from an answer to a heartbeat sent while idle;
    one given work the moment it joined, whose service then died, waited forever. With no
    answer at all (the service died before it answered the heartbeat sent at ready), a task
    received is word enough: the default rule applies."""
    from entrain_data.workers import worker as worker_module
    from entrain_data.workers.worker import run_remote_worker

    from entrain_data import protocol
    from entrain_data.errors import WorkerDied

    monkeypatch.setattr(worker_module, "SILENCE_S", 1.0)  # the default, short for the test
    ctx = zmq.Context()
    svc = ctx.socket(zmq.ROUTER)
    svc.setsockopt(zmq.LINGER, 0)
    port = svc.bind_to_random_port("tcp://127.0.0.1")
    raised: list[BaseException] = []

    def service() -> None:  # a task at once; answers until the task's reply, then dies
        while svc.poll(5000):
            ident, *frames = svc.recv_multipart()
            kind = protocol.decode(frames).kind
            if kind == "ready":
                svc.send_multipart([ident, *protocol.encode("task", _TASK)])
            elif kind == "heartbeat":
                if answers:
                    svc.send_multipart([ident, *protocol.encode("heartbeat", {"silence": 1.0})])
            else:
                return  # the task's reply: gone without a word

    def worker() -> None:
        try:
            run_remote_worker(f"tcp://127.0.0.1:{port}", _SlowSource(0.0), name="busy")
        except BaseException as exc:  # noqa: BLE001 - what it raised is the finding
            raised.append(exc)

    threads = [threading.Thread(target=f, daemon=True) for f in (service, worker)]
    try:
        for t in threads:
            t.start()
        threads[1].join(15)
        assert not threads[1].is_alive(), "the worker never noticed its service had gone"
        assert len(raised) == 1 and isinstance(raised[0], WorkerDied), raised
        assert "no word from the service for 1s" in str(raised[0])
    finally:
        threads[0].join(10)
        svc.close()
        ctx.term()


@pytest.mark.slow  # a 2.5 s task, then 3 s of heartbeats
def test_a_task_longer_than_the_silence_is_no_silence():
    """The silence clock ran through a long task (no heartbeats while packing), so the worker
    quit with "no word from the service" the moment it finished, its service alive."""
    from entrain_data.workers.worker import run_remote_worker

    from entrain_data import protocol

    ctx = zmq.Context()
    svc = ctx.socket(zmq.ROUTER)
    svc.setsockopt(zmq.LINGER, 0)
    port = svc.bind_to_random_port("tcp://127.0.0.1")
    seen: list[str] = []

    def service() -> None:  # answers as the coordinator does, stops the worker 3 s after
        stop_at = None
        while stop_at is None or time.monotonic() < stop_at:
            if not svc.poll(100):
                continue
            ident, *frames = svc.recv_multipart()
            kind = protocol.decode(frames).kind
            seen.append(kind)
            if kind == "ready":
                svc.send_multipart([ident, *protocol.encode("task", _TASK)])
            if kind in ("ready", "heartbeat"):
                svc.send_multipart([ident, *protocol.encode("heartbeat", {"silence": 2.0})])
            if kind == "failed":
                stop_at = time.monotonic() + 3.0
        svc.send_multipart([ident, *protocol.encode("stop")])

    thread = threading.Thread(target=service, daemon=True)
    thread.start()
    try:
        run_remote_worker(f"tcp://127.0.0.1:{port}", _SlowSource(), name="slow")  # no raise
        assert seen[0] == "ready" and "failed" in seen and "heartbeat" in seen
    finally:
        thread.join(10)
        svc.close()
        ctx.term()


def test_a_microbatch_lost_to_silent_workers_is_not_called_poison():
    """A remote worker dropped for silence may only be slow: three such drops of one
    microbatch stopped the service as if the microbatch killed its workers."""
    from entrain_data.workers.production import POISON_LOSSES, Flight, Production

    prod = Production(window=4, end_pos=100)
    for tid in range(POISON_LOSSES):
        prod.in_flight[tid] = Flight((0, 5), [], False, remote=True)
        assert prod.lost([tid], {}, died=False) == []
    for tid in range(10, 10 + POISON_LOSSES):
        prod.in_flight[tid] = Flight((0, 5), [], False)
        doomed = prod.lost([tid], {})
    assert doomed == [(0, 5)]  # deaths still do
