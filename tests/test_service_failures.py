"""Failures that speak at once (issue 15): typed errors, a service that dies, the skip record,
the error budget, configuration checked before any worker starts, background assignment."""

from __future__ import annotations

import inspect
import json
import os
import signal
import time
from dataclasses import dataclass

import pytest
from test_service import close_all, make_plan, make_shards, run_ranks, settled_stats, start

from entrain_data import protocol
from entrain_data.client import EntrainLoader
from entrain_data.errors import (
    EntrainError,
    InvalidInput,
    SampleError,
    ServiceStopped,
    WorkerDied,
    error_fields,
    error_from_fields,
)
from entrain_data.metadata import read_index

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def dataset(tmp_path):
    return make_shards(tmp_path)


# ------------------------------------------------------------------ the rooms (item 1)
def test_pool_has_an_explicit_signature_and_the_client_imports_workers_visibly():
    from entrain_data.workers import sample_source
    from entrain_data.workers.pool import WorkerPool

    params = inspect.signature(WorkerPool).parameters
    assert "cfg" not in params and {"endpoint", "source", "workers"} <= set(params)
    for name in ("IndexSource", "DatasetSource", "CustomSource", "Packed"):
        assert hasattr(sample_source, name)
    import entrain_data.client as client

    text = inspect.getsource(client)
    assert "import_module" not in text
    assert "from entrain_data.workers.service import start_service" in text


# ------------------------------------------------------------------ typed errors (item 2)
@pytest.mark.parametrize(
    "exc",
    [
        SampleError("bad jpeg", source="/d/shard-1.tar", key="k7"),
        InvalidInput("field x"),
        WorkerDied("gone"),
        ServiceStopped("stopped by SIGINT"),
    ],
)
def test_errors_cross_the_wire_typed_with_their_fields(exc):
    frames = protocol.encode("error", error_fields(exc))
    back = error_from_fields(protocol.decode(frames).header, prefix="svc: ")
    assert type(back) is type(exc) and str(back) == f"svc: {exc}"
    assert getattr(back, "source", None) == getattr(exc, "source", None)
    assert getattr(back, "key", None) == getattr(exc, "key", None)


def test_a_private_subclass_crosses_as_the_nearest_wire_type():
    """A module's own InvalidInput (path_patterns' missing-input error) arrived as a plain
    EntrainError, so ``except InvalidInput`` on the rank's side missed it."""

    class _Missing(InvalidInput):
        pass

    class _Skipped(SampleError):
        pass

    back = error_from_fields(error_fields(_Missing("shard x.tar not found")))
    assert type(back) is InvalidInput and str(back) == "shard x.tar not found"
    back = error_from_fields(error_fields(_Skipped("bad", source="s.tar", key="k")))
    assert type(back) is SampleError and (back.source, back.key) == ("s.tar", "k")

    class TransformFailed(EntrainError):  # a user's: no listed type nearer than EntrainError
        pass

    back = error_from_fields(error_fields(TransformFailed("bad crop")))
    assert type(back) is EntrainError and str(back) == "TransformFailed: bad crop"
    assert str(error_from_fields(error_fields(EntrainError("plain")))) == "plain"


def test_foreign_exceptions_cross_as_entrain_error_named_by_type():
    back = error_from_fields(error_fields(KeyError("x")))
    assert type(back) is EntrainError and "KeyError" in str(back)
    assert type(error_from_fields({"error_type": "SystemExit", "message": "m"})) is EntrainError


# ------------------------------------------------------- the service stops (item 3)
def test_a_signalled_service_tells_its_ranks_why_at_once(tmp_path, dataset):
    svc = start(tmp_path, dataset, make_plan())
    ld = EntrainLoader(svc.endpoint, 0, prefetch=1, timeout=60)
    try:
        it = iter(ld)
        next(it)
        os.kill(svc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(ServiceStopped, match="SIGTERM"):
            for _ in range(100):
                next(it)
        assert time.monotonic() - t0 < 10  # not the 60 s timeout
    finally:
        ld.close()
        svc.close()


@dataclass(frozen=True)
class FailingCosts:
    """Costs that fail in the coordinator, after the service process started."""

    def __call__(self):
        raise InvalidInput("costs.parquet: column 'llm_cost' is missing")


def test_a_service_that_dies_is_reported_by_its_clients_with_its_reason(tmp_path, dataset):
    from entrain_data.workers.service import start_service
    from test_service import TarTextPacker

    svc = start_service(
        plan=make_plan(),
        packer_factory=TarTextPacker(str(dataset)),
        table_costs=FailingCosts(),
        socket_dir=str(tmp_path / "entrain-sock"),
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(InvalidInput, match="exited: costs.parquet: column 'llm_cost'"):
            EntrainLoader(svc.endpoint, 0, timeout=60, _service=svc).info  # noqa: B018
        assert time.monotonic() - t0 < 30
    finally:
        svc.close()


# ------------------------------------------------ the skip record and budget (item 4)
@pytest.mark.slow
def test_skips_over_the_budget_stop_the_service_with_a_clear_error(tmp_path):
    index = make_shards(tmp_path, bad={"s0-0003": "missing", "s1-0010": "missing"})
    record = tmp_path / "skipped.jsonl"
    svc = start(tmp_path, index, make_plan(), on_error="skip", skipped_path=str(record))
    try:  # default budget: 1% of 48 samples = 0
        with pytest.raises(
            SampleError, match=r"over the error budget max_skipped=1%.*the first: s[01]-00(03|10): "
        ):  # why, not only how many
            run_ranks(svc.endpoint, [0, 1], timeout=30)
        assert svc.wait(15) != 0
    finally:
        svc.close()
    assert "s0-0003" in record.read_text() or "s1-0010" in record.read_text()


def test_the_record_names_skipped_and_left_out_samples_with_their_reasons(tmp_path):
    index = make_shards(tmp_path, per_shard=25, bad={"s0-0003": "missing"})  # 50 samples
    record = tmp_path / "skipped.jsonl"
    svc = start(
        tmp_path, index, make_plan(), on_error="skip", skipped_path=str(record), max_skipped="3%"
    )
    try:
        out, loaders = run_ranks(svc.endpoint, [0, 1])
        stats = settled_stats(loaders[0], sum(len(mb.llm_keys) for v in out.values() for mb in v))
        close_all(loaders)
        assert svc.wait(15) == 0
    finally:
        svc.close()
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    delivered = {k for mbs in out.values() for mb in mbs for k in mb.llm_keys}
    missing = set(read_index(index).keys) - delivered
    assert {e["key"] for e in entries} == missing  # every sample not delivered, and only those
    reasons = {e["key"]: e["reason"] for e in entries}
    assert reasons["s0-0003"].startswith("undecodable")
    left = [k for k, r in reasons.items() if r.startswith("left out")]
    assert len(left) == 2 and "epoch 0" in reasons[left[0]]
    assert stats["skipped_samples"] == 1 and stats["left_out_samples"] == 2


# ------------------------------------------- configuration checked at start (item 8)
@dataclass(frozen=True)
class BrokenFactory:
    """A packer recipe that cannot build (in the caller, before any worker)."""

    def __call__(self):
        raise TypeError("unsupported vision policy 'tiles' without a transform")


@dataclass(frozen=True)
class DiesInWorkers:
    """Builds in the caller, dies in every worker process before it says ready."""

    index: str

    def __call__(self):
        import multiprocessing

        if multiprocessing.current_process().name.startswith("entrain-worker"):
            os._exit(3)
        from test_service import TarTextPacker

        return TarTextPacker(self.index)()


def test_an_unbuildable_packer_is_one_error_in_the_caller(tmp_path, dataset):
    from entrain_data.workers.service import start_service
    from test_service import TextCosts

    with pytest.raises(InvalidInput, match="packer cannot be built: TypeError: unsupported"):
        start_service(
            plan=make_plan(),
            packer_factory=BrokenFactory(),
            table_costs=TextCosts(str(dataset)),
            socket_dir=str(tmp_path / "entrain-sock"),
        )
    assert not (tmp_path / "entrain-sock").exists()


@pytest.mark.slow
def test_a_worker_dying_on_start_twice_is_a_configuration_error_not_a_restart_loop(
    tmp_path, dataset
):
    from entrain_data.workers.service import start_service
    from test_service import TextCosts

    svc = start_service(
        plan=make_plan(),
        packer_factory=DiesInWorkers(str(dataset)),
        table_costs=TextCosts(str(dataset)),
        workers=1,
        socket_dir=str(tmp_path / "entrain-sock"),
    )
    try:
        with pytest.raises(WorkerDied, match="died on start 2 times in a row"):
            list(EntrainLoader(svc.endpoint, 0, timeout=60, _service=svc))
        assert svc.wait(15) != 0
    finally:
        svc.close()


@pytest.mark.slow  # three worker restarts
def test_a_sample_that_kills_every_worker_stops_the_service_naming_it(tmp_path, dataset):
    svc = start(tmp_path, dataset, make_plan(), die_on_key="s1-0005")
    try:
        with pytest.raises(WorkerDied, match=r"died each of the 3 times .*s1-0005") as info:
            run_ranks(svc.endpoint, [0, 1], timeout=60)
        assert "microbatch" in str(info.value) and "iteration" in str(info.value)
        assert svc.wait(15) != 0
    finally:
        svc.close()


# ------------------------------------------------------ background assignment (item 9)
def slow_assign(*args, **kwargs):
    """The plan's method, one second slower per iteration (picklable: module level)."""
    from entrain_data.assignment import assign

    time.sleep(1.0)
    return assign(*args, **kwargs)


@pytest.mark.slow
def test_the_serving_loop_answers_while_an_iteration_is_being_assigned(tmp_path, dataset):
    svc = start(tmp_path, dataset, make_plan(), assign_fn=slow_assign, window=12)
    ld = EntrainLoader(svc.endpoint, 0, prefetch=12, timeout=60)
    try:
        it = iter(ld)
        next(it)  # iteration 0 assigned; the window asks for iterations 1..3 (3 s of assignment)
        waits = []
        for _ in range(5):
            t0 = time.monotonic()
            stats = ld.stats()
            waits.append(time.monotonic() - t0)
        assert stats["assignment_latency_s"]["count"] < 4  # still assigning meanwhile
        assert max(waits) < 0.5, waits  # inline assignment would block a reply for ~1 s
        got = [next(it) for _ in range(3)]  # the rest of iteration 0 arrives too
        assert [(m.iteration, m.microbatch) for m in got] == [(0, 1), (0, 2), (1, 0)]
    finally:
        ld.close()
        svc.close()


# ------------------------------------------- samples delayed to the next iteration (item 9)
def test_a_delaying_method_chains_iterations_and_serves_each_sample_once_per_epoch():
    """wlb_llm delays outliers (``carried``): prepended to the next global batch, flushed at the
    epoch's end; a fresh scheduler asked for a late iteration first rebuilds the same queue."""
    import numpy as np
    from entrain_data.workers.schedule import Scheduler

    rng = np.random.default_rng(0)
    n = 96
    tokens = rng.integers(50, 400, n)
    tokens[rng.choice(n, 12, replace=False)] = 3000  # outliers the method holds back
    llm = tokens.astype(np.float64) ** 1.5
    kw = dict(
        dp=2, microbatches=3, global_batch=24, max_tokens=4096, defer_budget=None,
        method="wlb_llm", seed=5,
    )  # fmt: skip
    sch = Scheduler(np.zeros((n, 1)), llm, tokens, **kw)
    its = sch.shape.iterations
    served = {
        it: sorted(int(r) for rep in sch.slots(0, it) for s in rep for r in s.llm_rows)
        for it in range(its)
    }
    batches = sch.batches(0)
    assert sorted(r for v in served.values() for r in v) == sorted(
        int(r) for b in batches for r in b
    )
    moved = [it for it in range(its) if served[it] != sorted(int(r) for r in batches[it])]
    assert moved  # some samples did move to a later iteration
    fresh = Scheduler(np.zeros((n, 1)), llm, tokens, **kw)
    late = sorted(int(r) for rep in fresh.slots(0, its - 1) for s in rep for r in s.llm_rows)
    assert late == served[its - 1]  # resume mid-epoch: the same queue, rebuilt
