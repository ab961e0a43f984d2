"""The planner's memory and time models: LM-head logits, tensor parallelism over every module's
heads, calibrated per-call overheads, and the microbatch counts a small global batch allows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import PlanError
from entrain_data.plan import Cluster, StagePlan, StageSegment
from entrain_data.plan_layout import LOGIT_BYTES, memory_gb
from entrain_data.plan_time import OVERHEAD_PER_MICROBATCH, stage_overheads
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.workloads import synthesize

GB = 2**30


@pytest.fixture(scope="module")
def table():
    return synthesize("vision-audio", 600, seed=0)


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_names(["siglip-so400m", "whisper-large-v3-encoder"], "llama-3.2-1b")


def _llm_stages(n: int = 16) -> tuple[StagePlan, ...]:
    half = n // 2
    return (
        StagePlan(0, (StageSegment("llm", None, 0, half, True, False),)),
        StagePlan(1, (StageSegment("llm", None, half, n, False, True),)),
    )


@pytest.mark.parametrize(("schedule", "m", "tp"), [("1f1b", 4, 1), ("1f1b", 4, 2), ("gpipe", 4, 1)])
def test_the_lm_head_stage_holds_the_logits_and_the_losss_fp32_tensors(schedule, m, tp):
    """llama-3.2-1b at 65,792 tokens: 15.7 GB of bf16 logits alone were left out. The loss
    upcasts (``F.cross_entropy(logits.float())``): bf16 + fp32 copy + fp32 log-softmax, the
    last saved for each microbatch in flight."""
    model = ModelSpec.from_names([], "llama-3.2-1b")
    small = replace(model, llm=replace(model.llm, vocab=1000))
    args = (_llm_stages(), tp, 1, m, 65_792, 0, 0)
    big_mem = memory_gb(model, *args, schedule=schedule)
    small_mem = memory_gb(small, *args, schedule=schedule)
    inflight = m if schedule == "gpipe" else 1  # the LM head sits on the last stage
    per_logit = LOGIT_BYTES[0] + LOGIT_BYTES[1] + LOGIT_BYTES[2] * inflight
    logits = 65_792 * (128_256 - 1000) * per_logit / tp / GB
    assert big_mem[1] - small_mem[1] == pytest.approx(logits, rel=1e-9)
    bf16_logits = 65_792 * 128_256 * 2 / GB
    assert bf16_logits == pytest.approx(15.7, abs=0.05)  # the audit's figure, now counted
    # the first stage holds the embedding (tied: the LM head reuses it), never the logits
    emb = (128_256 - 1000) * 2048 * (6 + 12) / tp / GB  # optimizer sharding, dp=1
    assert big_mem[0] - small_mem[0] == pytest.approx(emb, rel=1e-9)


def test_a_microbatch_whose_logits_do_not_fit_is_refused():
    """One microbatch of a 16-sample text-heavy batch carries ~100k tokens: their logits and
    loss tensors need ~130 GB, which recomputation cannot free (the plan was accepted). Left
    free, the planner takes more microbatches and reports the logits in its memory."""
    model = ModelSpec.from_names(["siglip-so400m"], "llama-3.2-1b")
    t = synthesize("text-heavy", 200, seed=0)
    kw = dict(batches=1, shardings=("optimizer",))
    with pytest.raises(PlanError, match="GB per GPU"):
        make_plan(t, model, Cluster(1), 16, microbatches=1, **kw)
    plan = make_plan(t, model, Cluster(1), 16, **kw)
    assert plan.microbatches > 1
    logits = plan.max_tokens * model.llm.vocab * sum(LOGIT_BYTES) / plan.tp / GB
    assert logits < plan.memory_gb[-1] <= 0.9 * 80


def test_tp_must_split_every_encoders_heads(table, spec):
    """whisper-large-v3 has 20 heads: tp=8 shards no attention of it evenly."""
    assert spec.encoders[1].heads == 20
    with pytest.raises(PlanError, match="whisper-large-v3-encoder") as err:
        make_plan(table, spec, Cluster(16), 64, batches=2, tp=8)
    assert "tp=8" in str(err.value) and "20 attention heads" in str(err.value)
    plan = make_plan(table, spec, Cluster(16), 64, batches=2)
    tps = {plan.tp} | {x["tp"] for x in plan.search["simulated"]}
    assert all(20 % t == 0 and 16 % t == 0 for t in tps)


def _calibration(constant: float, phase: str = "forward") -> dict:
    fit = {"linear": 1.0, "quadratic": 1.0, "constant": constant, "phase": phase}
    return {"hardware": "h100-sxm-bf16", "modules": {"llm": fit, "siglip-so400m": fit}}


def test_calibrated_call_overheads_enter_the_stage_times():
    """A calibrated 0.5 s per call used to leave the plan unchanged."""
    model = ModelSpec.from_names(["siglip-so400m"], "llama-3.2-1b")
    t = synthesize("llava-fixed", 400, seed=0)
    costs = per_sample_costs(t, model, calibration=_calibration(0.5))
    stages = _llm_stages()
    f, b = stage_overheads(costs, stages)
    # half the LLM's layers each: half its forward overhead, twice that in backward
    assert f == pytest.approx([0.25 + OVERHEAD_PER_MICROBATCH] * 2)
    assert b == pytest.approx([0.5 + OVERHEAD_PER_MICROBATCH] * 2)
    f_rc, b_rc = stage_overheads(costs, stages, (False, True))  # recomputation repeats forward
    assert b_rc == pytest.approx([0.5 + OVERHEAD_PER_MICROBATCH, 0.75 + OVERHEAD_PER_MICROBATCH])
    step = per_sample_costs(t, model, calibration=_calibration(0.6, "step"))
    assert step.llm_call_overhead == pytest.approx(0.2)  # forward share of 1 + 2
    assert np.allclose(stage_overheads(None, stages), OVERHEAD_PER_MICROBATCH)

    kw = dict(batches=2, seed=0)
    base = make_plan(t, model, Cluster(8), 64, calibration=_calibration(0.0), **kw)
    slow = make_plan(t, model, Cluster(8), 64, calibration=_calibration(0.5), **kw)
    # every microbatch pays 0.5 s forward + 1 s backward of LLM calls on its way through
    assert slow.expected_iteration_time > base.expected_iteration_time + 1.5 * slow.microbatches
    # fewer, larger microbatches pay fewer calls
    assert slow.microbatches <= base.microbatches
    for row in slow.search["simulated"]:
        assert row["analytic_time"] > 1.5 * row["microbatches"]


def test_small_global_batch_on_a_deep_pipeline_gets_a_plan(table, spec):
    """gb 4 on pp=8: the searched counts 8..64 need more samples than a replica has, so the
    unpinned search refused what a pinned microbatches=2 accepts."""
    plan = make_plan(table, spec, Cluster(16), 4, batches=2, pp=8, tp=1)
    assert (plan.dp, plan.microbatches) == (2, 2)
    pinned = make_plan(table, spec, Cluster(16), 4, batches=2, pp=8, tp=1, microbatches=2)
    assert pinned.microbatches == plan.microbatches
