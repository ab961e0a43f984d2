"""The loader service's encoder cost columns (:mod:`entrain_data.cost_columns`): encoders laid
out alike over the stages are balanced as one column, encoders laid out differently as one
each, and the plan, the planner's scoring and the service agree on them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from entrain_data.workers.schedule import data_fingerprint, frozen_columns

from entrain_data.assignment import assign
from entrain_data.cost_columns import column_shares, group_columns, share_columns
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment
from entrain_data.presets import ModelSpec
from entrain_data.simulator import (
    simulate_pipeline,
    stage_sample_costs,
    stage_shares,
    times_from_sample_costs,
)
from entrain_data.workloads import synthesize

VLA = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-3b")


def test_equal_layouts_share_a_column_and_different_ones_do_not():
    together = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # both encoders on stage 0
    assert share_columns(together) == [[0, 1]]
    assert share_columns(together, [True, False]) == [[0], [1]]  # frozen apart
    split = np.array([[1.0, 0.2, 0.0], [0.0, 0.8, 0.0], [0.0, 0.0, 1.0]])
    assert share_columns(split) == [[0], [1]]
    three = np.array([[1.0, 0.3, 1.0, 0.0], [0.0, 0.7, 0.0, 1.0]])
    assert share_columns(three) == [[0, 2], [1]]
    np.testing.assert_allclose(column_shares(three, [[0, 2], [1]]), three[:, [0, 1, 3]])
    assert share_columns(np.ones((2, 1)) / 2) == []
    enc = np.array([[1.0, 10.0, 100.0], [2.0, 20.0, 200.0]])
    np.testing.assert_allclose(group_columns(enc, [[0, 2], [1]]), [[101, 10], [202, 20]])
    assert group_columns(enc[:, :0], []).shape == (2, 0)
    with pytest.raises(InvalidInput, match="other encoders than the 3 given"):
        group_columns(enc, [[0], [1]])
    with pytest.raises(InvalidInput, match="2 frozen flags for 1 encoders"):
        share_columns(np.ones((1, 2)), [True, False])


def _plan(stages: list[list[tuple]], costs) -> ParallelPlan:
    """A plan of these stages ((module, encoder index, start, end) per segment), dp 4, M 16,
    with its shares measured on ``costs``."""
    segs = []
    for st in stages:
        segs.append(
            StagePlan(
                len(segs),
                tuple(StageSegment(m, e, a, b, a == 0, b == n) for m, e, a, b, n in st),
            )
        )
    plan = ParallelPlan(
        world_size=4 * len(segs), gpus_per_node=8, dp=4, tp=1, pp=len(segs), stages=tuple(segs),
        microbatches=16, global_batch=512, max_tokens=1 << 20, defer_budget=1 << 20,
        method="entrain", model=VLA.to_dict(),
    )  # fmt: skip
    return plan.with_stage_shares(costs)


def test_the_plan_serves_a_column_per_layout_and_keeps_older_plans():
    costs = per_sample_costs(synthesize("vision-audio", 512, seed=1), VLA)
    vit, aud, llm = ("qwen2.5-vl-vision", 0, 32), ("whisper-large-v3-encoder", 1, 32), 28
    one = _plan([[(*vit[:2], 0, 32, 32), (*aud[:2], 0, 32, 32), ("llm", None, 0, 14, llm)],
                 [("llm", None, 14, 28, llm)]], costs)  # fmt: skip
    assert one.encoder_groups() == [[0, 1]] and one.cost_columns() == [[0, 1]]
    np.testing.assert_allclose(
        one.column_costs(costs.encoder_cost()), costs.encoder_cost().sum(1)[:, None]
    )
    assert one.shares_for(1).shape == (2, 2) and one.shares_for(2) is None
    apart = _plan([[(*vit[:2], 0, 32, 32), (*aud[:2], 0, 12, 32)], [(*aud[:2], 12, 32, 32)],
                   [("llm", None, 0, 28, llm)]], costs)  # fmt: skip
    assert apart.encoder_groups() == [[0, 1]] and apart.cost_columns() == [[0], [1]]
    np.testing.assert_allclose(apart.shares_for(2), np.asarray(apart.stage_shares))
    frozen = replace(one, model=replace(VLA, encoders=(replace(VLA.encoders[0], frozen=True),
                                                       VLA.encoders[1])).to_dict())  # fmt: skip
    assert frozen.cost_columns() == [[0], [1]] and frozen.frozen_columns() == [True, False]
    both = replace(apart, model=replace(VLA, encoders=tuple(replace(e, frozen=True)
                                                            for e in VLA.encoders)).to_dict())  # fmt: skip
    assert both.cost_columns() == [[0], [1]] and both.frozen_columns() == [True, True]
    # a user's one summed column beside these plans: frozen only where every encoder is
    assert frozen_columns(both, np.zeros((4, 1))) == [True]
    assert frozen_columns(frozen, np.zeros((4, 1))) == [False]
    legacy = ParallelPlan.from_dict(
        {**apart.to_dict(), "stage_shares": [[0.5, 0], [0.5, 0], [0, 1]]}
    )
    assert legacy.cost_columns() == [[0, 1]] and legacy.shares_for(1).shape == (3, 2)
    assert replace(apart, stage_shares=()).cost_columns() == [[0, 1]]  # none recorded


def test_a_column_per_layout_runs_faster_where_the_encoders_lie_apart():
    """The planner's layout for this pairing: the vision tower and the first 5 audio layers on
    stage 0, the rest of the audio tower on stage 1, the LLM on stages 2-3. One summed column
    tells the proxy the same split for an image as for a clip; a column each tells it where
    each sample's work lands (measured 9.1-9.9% faster over seeds 0-2; with 8 samples a
    microbatch instead of 2, 4-10%)."""
    spec = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-1b")
    costs = per_sample_costs(synthesize("vision-audio", 1024, seed=1), spec)
    vit, aud = ("qwen2.5-vl-vision", 0), ("whisper-large-v3-encoder", 1)
    plan = _plan([[(*vit, 0, 32, 32), (*aud, 0, 5, 32)], [(*aud, 5, 32, 32)],
                  [("llm", None, 0, 10, 16)], [("llm", None, 10, 16, 16)]], costs)  # fmt: skip
    plan = replace(plan, model=spec.to_dict()).with_stage_shares(costs)
    assert plan.cost_columns() == [[0], [1]]
    per = stage_sample_costs(costs, plan.stages)
    served = (plan.column_costs(costs.encoder_cost()), plan.shares_for(2))
    summed = (
        costs.encoder_cost().sum(axis=1, keepdims=True),
        stage_shares(costs, plan.stages, [[0, 1]]),
    )
    t = np.zeros(2)
    llm_cost, tok = costs.llm_cost(), costs.llm_tokens.astype(np.int64)
    for it in range(4):
        rows = np.arange(it * 256, (it + 1) * 256)
        for i, (enc, sh) in enumerate((summed, served)):
            a = assign(enc[rows], llm_cost[rows], tok[rows], dp=4, microbatches=32,
                       iteration=it, stage_shares=sh)  # fmt: skip
            t[i] += simulate_pipeline(*times_from_sample_costs(a, per, rows)).iteration_time
    assert t[1] < 0.97 * t[0], t


def test_the_data_fingerprint_does_not_see_how_the_encoders_are_columned():
    """Two columns hash as their sum (a re-plan that columns the encoders otherwise cuts the
    same batches); one column, or none (a text-only index), hashes as it always did."""
    rng = np.random.default_rng(0)
    enc, llm, tok = rng.random((50, 2)), rng.random(50), np.arange(50)

    def fp(e):
        return data_fingerprint(e, llm, tok, None, seed=0, global_batch=16)

    assert fp(enc) == fp(enc.sum(axis=1, keepdims=True)) == fp(enc.sum(axis=1))
    assert fp(np.zeros((50, 0))) != fp(np.zeros((50, 1)))  # no encoder: no bytes, as before
