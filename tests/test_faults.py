"""Faults: a worker killed mid-epoch, the coordinator gone, garbage and foreign peers, CURVE."""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest
import zmq
from entrain_data.workers.sample_source import Packed
from test_service import (
    assert_exactly_once,
    close_all,
    make_index_plan,
    make_plan,
    run_ranks,
    start,
)

from entrain_data import protocol
from entrain_data.client import EntrainLoader
from entrain_data.errors import EntrainTimeout, ProtocolError
from entrain_data.metadata import read_index

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def dataset(tmp_path):
    from test_service import make_shards

    return make_shards(tmp_path)


def _lockstep(loaders, its, out, n):
    for _ in range(n):
        for ld, it in zip(loaders, its):
            out[ld.rank].append(next(it))


def _rest(loaders, its, out):
    for ld, it in zip(loaders, its):
        out[ld.rank].extend(it)


@pytest.mark.slow
def test_worker_killed_mid_epoch_is_restarted_and_epoch_stays_exactly_once(tmp_path, dataset):
    svc = start(tmp_path, dataset, make_plan())
    loaders = [EntrainLoader(svc.endpoint, r, prefetch=2, timeout=30) for r in (0, 1)]
    try:
        its = [iter(ld) for ld in loaders]
        out = {0: [], 1: []}
        _lockstep(loaders, its, out, 3)
        victim = loaders[0].stats()["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        _rest(loaders, its, out)
        assert_exactly_once(out, list(read_index(dataset).keys))
        stats = loaders[0].stats()
        gens = {w["worker"]: w["generation"] for w in stats["workers"]}
        assert gens[0] == 1 and victim not in [w["pid"] for w in stats["workers"]]
    finally:
        close_all(loaders)
        svc.close()


def test_worker_dying_inside_a_task_gets_its_task_reissued(tmp_path, dataset):
    svc = start(
        tmp_path, dataset, make_plan(), workers=1, die_on_task=4, die_marker=str(tmp_path / "died")
    )
    try:
        out, loaders = run_ranks(svc.endpoint, [0, 1])
        assert_exactly_once(out, list(read_index(dataset).keys))
        stats = loaders[0].stats()
        assert stats["tasks_reissued"] >= 1 and stats["workers"][0]["generation"] >= 1
        close_all(loaders)
    finally:
        svc.close()


@pytest.mark.slow  # 15-26 s on 2 cores (the default run stays near 10 minutes)
def test_coordinator_gone_every_client_raises_within_its_timeout(tmp_path, dataset):
    svc = start(tmp_path, dataset, make_plan())
    loaders = [EntrainLoader(svc.endpoint, r, prefetch=1, timeout=30) for r in (0, 1)]
    try:
        its = [iter(ld) for ld in loaders]
        for it in its:
            next(it)
        for ld in loaders:
            ld.timeout = 2.0
        os.kill(svc.pid, signal.SIGKILL)
        svc.process.join(5)
        for it in its:
            t0 = time.monotonic()
            with pytest.raises(
                EntrainTimeout, match=r"iteration \d+ microbatch \d+.*service\.sock"
            ):
                for _ in range(100):
                    next(it)
            assert time.monotonic() - t0 < 2.0 * 3 + 1
    finally:
        close_all(loaders)
        svc.close()


def _raw(endpoint):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.connect(endpoint)
    return s


@pytest.mark.slow  # 15-26 s on 2 cores (the default run stays near 10 minutes)
def test_garbage_foreign_version_and_unknown_peers_are_rejected_service_keeps_serving(
    tmp_path, dataset
):
    svc = start(tmp_path, dataset, make_plan())
    raw = _raw(svc.endpoint)
    try:
        good = [EntrainLoader(svc.endpoint, r, prefetch=2, timeout=30) for r in (0, 1)]
        its = [iter(ld) for ld in good]
        out = {0: [], 1: []}
        _lockstep(good, its, out, 2)
        bad_messages = [
            [b"\x00garbage", b"more"],
            [msgpack.packb({"v": protocol.PROTOCOL_VERSION + 7, "kind": "hello", "rank": 0})],
            protocol.encode("credit", {"n": 5}),  # never said hello
            protocol.encode("hello", {"rank": 99}),  # no such rank
            [
                msgpack.packb(
                    {
                        "v": protocol.PROTOCOL_VERSION,
                        "kind": "batch",
                        "tensors": [["x", "int64", [2], 16]],
                    }
                ),
                b"123",
            ],
        ]
        for frames in bad_messages:
            raw.send_multipart(frames)
            reply = protocol.decode(raw.recv_multipart())
            assert reply.kind == "error" and reply.header["message"]
        _rest(good, its, out)
        assert_exactly_once(out, list(read_index(dataset).keys))
        assert good[0].stats()["rejected_messages"] == len(bad_messages)
        close_all(good)
    finally:
        raw.close(0)
        svc.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_curve_client_without_the_key_is_rejected(tmp_path, dataset):
    pub, sec = zmq.curve_keypair()
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    svc = start(
        tmp_path,
        dataset,
        make_plan(),
        endpoint=endpoint,
        curve_public_key=pub,
        curve_secret_key=sec,
    )
    try:
        with pytest.raises(EntrainTimeout, match="welcome"):
            EntrainLoader(endpoint, 0, timeout=3.0).info  # noqa: B018
        keyed = [EntrainLoader(endpoint, r, timeout=30, curve_server_key=pub) for r in (0, 1)]
        out = {0: [], 1: []}
        _rest(keyed, [iter(ld) for ld in keyed], out)
        assert_exactly_once(out, list(read_index(dataset).keys))
        close_all(keyed)
    finally:
        svc.close()


def test_script_without_main_guard_fails_clearly_and_leaves_no_ipc_dir(tmp_path, dataset):
    """spawn re-imports a script without ``if __name__ == "__main__":`` in the service process,
    which then fails to start its own service: the user sees the error, and neither process
    leaves an ``entrain-*`` ipc directory behind."""
    import subprocess
    import sys

    plan = make_index_plan().save(tmp_path / "plan.json")
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from entrain_data.client import EntrainLoader\n"
        f"with EntrainLoader.local(rank=0, index={str(dataset)!r}, plan={str(plan)!r},\n"
        "                         workers=1, timeout=30) as loader:\n"
        "    next(iter(loader))\n"
    )
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert proc.returncode != 0
    assert "__main__" in proc.stderr  # multiprocessing's own explanation reaches the user
    assert list(tmp.glob("entrain-*")) == []


@dataclass(frozen=True)
class _OddPacker:
    """A user's packer that returns a tensor of strings (text not turned into ids), or a torch
    bfloat16 tensor (numpy has no such dtype)."""

    kind: str = "str"

    def __call__(self):
        return self._pack_str if self.kind == "str" else self._pack_bf16

    @staticmethod
    def _pack_str(encoder_rows, llm_rows) -> Packed:
        keys = [str(r) for r in llm_rows]
        tensors = {"input_ids": np.zeros(4, np.int64), "text": np.array(keys)}
        return Packed([str(r) for r in encoder_rows], keys, tensors)

    @staticmethod
    def _pack_bf16(encoder_rows, llm_rows) -> Packed:
        import torch

        tensors = {"input_ids": np.zeros(4, np.int64), "text": torch.zeros(4).bfloat16()}
        return Packed([str(r) for r in encoder_rows], [str(r) for r in llm_rows], tensors)


@pytest.mark.parametrize(
    ("kind", "said"),
    [("str", "a <U.* array is not allowed"), ("bf16", "a bfloat16 tensor is not allowed")],
)
def test_a_packer_tensor_the_wire_cannot_carry_stops_the_service_by_name(
    tmp_path, dataset, kind, said
):
    """It raised in the worker outside the task's handler: the worker died three times and the
    ranks were told of a sample that crashes the decoder or one larger than memory."""
    from entrain_data.workers.sample_source import CustomSource
    from entrain_data.workers.service import start_service
    from test_service import IndexKeys, TextCosts

    index = str(dataset)
    source = CustomSource(_OddPacker(kind), TextCosts(index), IndexKeys(index))
    svc = start_service(
        plan=make_plan(), source=source, socket_dir=str(tmp_path / "entrain-sock"), workers=1
    )
    try:
        with pytest.raises(ProtocolError, match=f"tensor 'text': {said}"):
            run_ranks(svc.endpoint, [0, 1])
        svc.wait(30)
        assert isinstance(svc.failure(), ProtocolError)
        assert "WorkerDied" not in repr(svc.failure())
    finally:
        svc.close()
