"""The service's schedule with the plan's opt-in bounded delay (``plan.max_delay``)."""

from __future__ import annotations

import numpy as np
import pytest
from entrain_data.workers.schedule import Scheduler

from entrain_data.assignment import assign
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput
from entrain_data.presets import ModelSpec
from entrain_data.workloads import synthesize

SPEC = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")


@pytest.fixture(scope="module")
def costs():
    table = synthesize("qwen2vl-dynamic", 1024, seed=5)  # heavy-tailed: some samples wait
    c = per_sample_costs(table, SPEC)
    return c.encoder_cost(), c.llm_cost(), c.llm_tokens


def _scheduler(costs, max_delay: int, **kw) -> Scheduler:
    enc, llm, tok = costs
    return Scheduler(
        enc, llm, tok, dp=4, microbatches=4, global_batch=128, max_tokens=None,
        defer_budget=None, method="entrain", seed=3, max_delay=max_delay, **kw,
    )  # fmt: skip


def _iteration_rows(s: Scheduler, epoch: int, it: int) -> tuple[np.ndarray, np.ndarray]:
    slots = s.slots(epoch, it)
    enc = np.concatenate([x.encoder_rows for rep in slots for x in rep])
    llm = np.concatenate([x.llm_rows for rep in slots for x in rep])
    return enc, llm


def test_every_sample_once_per_epoch_within_the_delay(costs):
    s = _scheduler(costs, max_delay=2)
    for epoch in range(2):
        batches = s.batches(epoch)
        home = {int(r): i for i, b in enumerate(batches) for r in b}
        seen_enc, seen_llm, moved = [], [], 0
        for it in range(s.shape.iterations):
            enc, llm = _iteration_rows(s, epoch, it)
            assert sorted(enc.tolist()) == sorted(llm.tolist())  # E and L of one iteration
            for r in enc.tolist():
                assert 0 <= it - home[r] <= 2, (r, home[r], it)
                moved += it != home[r]
            seen_enc += enc.tolist()
            seen_llm += llm.tolist()
        everyone = sorted(r for b in batches for r in b.tolist())
        assert sorted(seen_enc) == everyone and sorted(seen_llm) == everyone
        assert moved > 0  # the delay is used on a heavy-tailed mix


def test_delayed_stream_is_a_pure_function_of_the_seed(costs):
    a, b = _scheduler(costs, 2), _scheduler(costs, 2)
    last = a.shape.iterations - 1
    # b starts mid-epoch (a resume, or a lagging rank's iteration dropped from the cache)
    for it in (5, 2, last, 0):
        for x, y in zip(_iteration_rows(a, 0, it), _iteration_rows(b, 0, it)):
            assert np.array_equal(x, y)
    for it in range(a.shape.iterations):
        for x, y in zip(_iteration_rows(a, 1, it), _iteration_rows(_scheduler(costs, 2), 1, it)):
            assert np.array_equal(x, y)


def test_a_lagging_rank_costs_one_assignment_not_a_replay_of_its_epoch(costs):
    """An iteration dropped from the cache was re-assigned from the epoch's start: a replica
    14 iterations behind cost 14 assignments each time it asked (seconds at 8192 samples)."""
    calls = []

    def counted(*a, **kw):
        calls.append(kw["iteration"])
        return assign(*a, **kw)

    enc, llm, tok = costs
    s = Scheduler(
        enc, llm, tok, dp=4, microbatches=4, global_batch=128, max_tokens=None,
        defer_budget=None, method="entrain", seed=3, max_delay=2, cache=2, assign_fn=counted,
    )  # fmt: skip
    fresh = _scheduler(costs, 2)
    for it in range(6):
        s.slots(0, it)
    calls.clear()
    for it in (1, 4, 2):  # all dropped from the two-iteration cache
        for x, y in zip(_iteration_rows(s, 0, it), _iteration_rows(fresh, 0, it)):
            assert np.array_equal(x, y)  # the same stream as ever
    assert calls == [1, 4, 2]


def test_a_resume_mid_epoch_replays_only_its_segment(costs):
    """Nothing waits across a segment's end (``delay_segment`` iterations): a fresh service
    asked for an iteration deep in an epoch assigns from its segment's start, not from the
    epoch's (a replay of thousands of iterations, minutes before the first microbatch), and
    serves exactly what a service that ran from the start serves."""
    calls = []

    def counted(*a, **kw):
        calls.append(kw["iteration"])
        return assign(*a, **kw)

    ran = _scheduler(costs, 2, delay_segment=3)
    resumed = _scheduler(costs, 2, delay_segment=3, assign_fn=counted)
    batches = ran.batches(0)
    home = {int(r): i for i, b in enumerate(batches) for r in b}
    served, moved = [], 0
    for it in range(ran.shape.iterations):
        enc, _ = _iteration_rows(ran, 0, it)
        for r in enc.tolist():
            assert it // 3 == home[r] // 3 and 0 <= it - home[r] <= 2, (r, home[r], it)
            moved += it != home[r]
        served += enc.tolist()
    assert sorted(served) == sorted(r for b in batches for r in b.tolist()) and moved > 0
    for x, y in zip(_iteration_rows(ran, 0, 7), _iteration_rows(resumed, 0, 7)):
        assert np.array_equal(x, y)
    assert calls == [6, 7]  # its segment (the epoch's last two), not iterations 0-7
    with pytest.raises(InvalidInput, match="delay_segment"):
        _scheduler(costs, 2, delay_segment=0)


def test_without_delay_every_sample_stays_in_its_iteration(costs):
    s = _scheduler(costs, max_delay=0)
    for it, rows in enumerate(s.batches(0)):
        enc, _ = _iteration_rows(s, 0, it)
        assert sorted(enc.tolist()) == sorted(rows.tolist())


@pytest.mark.slow  # 15-26 s on 2 cores (the default run stays near 10 minutes)
def test_service_serves_a_plan_with_bounded_delay_exactly_once(tmp_path):
    from dataclasses import replace

    from test_service import (
        assert_exactly_once,
        close_all,
        make_plan,
        make_shards,
        run_ranks,
        start,
    )

    from entrain_data.metadata import read_index

    index = make_shards(tmp_path, shards=2, per_shard=36)
    plan = replace(make_plan(global_batch=12), max_delay=2)
    svc = start(tmp_path, index, plan)
    try:
        out, loaders = run_ranks(svc.endpoint, [0, 1])
        assert_exactly_once(out, list(read_index(index).keys))
        close_all(loaders)
        assert svc.wait(15) == 0
    finally:
        svc.close()


def test_a_plan_with_frozen_encoders_tells_the_assignment(costs):
    """``make_plan(..., frozen_encoder=True)`` -> the plan's encoder columns are frozen -> the
    service's schedule passes that to ``assign`` (entrain's proxy then places no encoder
    backward in the LLM sets); a trainable plan passes nothing."""
    from entrain_data.workers.schedule import frozen_columns

    from entrain_data.plan import Cluster
    from entrain_data.planner import make_plan

    table = synthesize("qwen2vl-dynamic", 400, seed=1)
    enc, llm, tok = costs
    for frozen in (True, False):
        plan = make_plan(table, SPEC, Cluster(4), 64, frozen_encoder=frozen, batches=2)
        cols = frozen_columns(plan, enc)
        assert cols == [frozen] * enc.shape[1]
        seen = []

        def record(*a, seen=seen, **kw):
            seen.append(kw.get("frozen_encoders"))
            return assign(*a, **kw)

        s = Scheduler(
            enc, llm, tok, dp=4, microbatches=4, global_batch=128, max_tokens=None,
            defer_budget=None, method="entrain", seed=3, assign_fn=record, frozen_encoders=cols,
        )  # fmt: skip
        s.slots(0, 0)
        assert seen == [cols if frozen else None]
