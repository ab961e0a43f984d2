"""``assign(stage_shares=)``: entrain's proxy pipeline runs on the plan's stages when told them.

The shares come from :func:`entrain_data.simulator.stage_shares` (each module's share of work
on every stage), the planner records them in the plan and the loader service passes them.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from entrain_data.workers.schedule import Scheduler, plan_shares

from entrain_data.assignment import assign
from entrain_data.assignment.pipeline_search import _module_totals, proxy_stage_shares
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput
from entrain_data.plan import Cluster, ParallelPlan
from entrain_data.plan_layout import layer_units, stages_for
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.simulator import (
    simulate_pipeline,
    stage_sample_costs,
    stage_shares,
    times_from_sample_costs,
)
from entrain_data.workloads import synthesize

VL = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")
VLA = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-3b")


def _setup(workload: str, spec: ModelSpec, enc_stages: int, n: int = 2048, seed: int = 3):
    costs = per_sample_costs(synthesize(workload, n, seed=seed), spec)
    rows = np.arange(n)
    stages = stages_for(spec, layer_units(spec, costs, rows.reshape(-1, 512)), 4, enc_stages)
    assert stages is not None
    return costs, stages


def _sets(a) -> list:
    return [[[int(i) for i in s] for s in row] for row in (*a.encoder_sets, *a.llm_sets)]


def test_shares_are_each_modules_work_on_every_stage():
    """One column per encoder then the LLM, each summing to 1; a stage's share of the LLM is
    its LLM forward + backward over the whole LLM's (what :func:`stage_sample_costs` gives)."""
    costs, stages = _setup("qwen2vl-dynamic", VLA, 2)
    sh = stage_shares(costs, stages)
    assert sh.shape == (4, 3)
    np.testing.assert_allclose(sh.sum(axis=0), 1.0)
    ef, eb, lf, lb = stage_sample_costs(costs, stages)
    llm = (lf + lb).sum(axis=0)
    np.testing.assert_allclose(sh[:, -1], llm / llm.sum())
    enc = (ef + eb).sum(axis=0)  # both encoders' columns together, per stage
    per_enc = costs.encoder_cost().sum(axis=0)
    np.testing.assert_allclose(sh[:, :-1] @ per_enc, enc)
    # a stage that recomputes runs its forward twice: its share grows
    rc = stage_shares(costs, (replace(stages[0], recompute=True), *stages[1:]))
    assert rc[0, 0] > sh[0, 0] and rc[0, 1] == sh[0, 1] == 0.0
    # grouped (the service's columns): the two encoders as one column
    g = stage_shares(costs, stages, groups=[[0, 1]])
    np.testing.assert_allclose(g[:, 0], enc / enc.sum())
    np.testing.assert_allclose(g[:, 1], sh[:, -1])


def test_rows_choose_the_samples_and_a_module_without_work_is_shared_by_layers():
    costs, stages = _setup("qwen2vl-dynamic", VLA, 2)
    text = np.flatnonzero(costs.encoder_cost()[:, 1] == 0)  # samples without audio
    sh = stage_shares(costs, stages, rows=text)
    layers = np.array(
        [
            sum(s.layer_end - s.layer_start for s in st.segments if s.encoder_index == 1)
            for st in stages
        ],
        float,
    )
    np.testing.assert_allclose(sh[:, 1], layers / layers.sum())
    with pytest.raises(InvalidInput, match="encoder 1, which no group"):
        stage_shares(costs, stages, groups=[[0]])


def test_told_the_proxys_own_layout_nothing_changes():
    """The mechanism replaces only where the stages come from: told the shares the proxy
    would lay out from the batch's totals, entrain assigns exactly as without them."""
    costs, _ = _setup("qwen2vl-dynamic", VLA, 2, n=512)
    enc, llm, tok = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens.astype(np.int64)
    valid = np.ones((1, len(llm)), bool)
    own = proxy_stage_shares(_module_totals(enc[None], llm[None], valid), 4)
    own[0, own.sum(axis=0) == 0] = 1.0  # no audio in the batch: a plan still places it
    for delay in (0, 2):
        kw = dict(dp=4, microbatches=16, iteration=1, max_delay=delay)
        a = assign(enc, llm, tok, pipeline_stages=4, **kw)
        b = assign(enc, llm, tok, stage_shares=own, **kw)
        assert _sets(a) == _sets(b) and np.array_equal(a.carried, b.carried)


def test_told_the_plans_stages_the_iterations_run_faster_on_them():
    """With three encoder stages and one LLM stage (the planner's layout for dynamic-resolution
    images on a 1B LLM), the proxy's own layout misplaces the encoder cuts; told the plan's,
    entrain's iterations run faster on the plan's stages (measured 2.1-3.2% over seeds 0-2)."""
    costs, stages = _setup("qwen2vl-dynamic", VL, 3)
    enc, llm, tok = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens.astype(np.int64)
    per, sh = stage_sample_costs(costs, stages), stage_shares(costs, stages)
    t = np.zeros(2)
    for it in range(4):
        rows = np.arange(it * 512, (it + 1) * 512)
        for i, kw in enumerate(({"pipeline_stages": 4}, {"stage_shares": sh})):
            a = assign(enc[rows], llm[rows], tok[rows], dp=4, microbatches=16, iteration=it, **kw)
            t[i] += simulate_pipeline(*times_from_sample_costs(a, per, rows)).iteration_time
    assert t[1] < 0.99 * t[0], t


@pytest.mark.parametrize(
    ("shares", "kw", "match"),
    [
        (np.full((4, 2), 0.25), {"pipeline_stages": 2}, "not the pipeline depth 2"),
        (np.full((4, 3), 0.25), {}, r"must be \[S, 2\]"),
        (np.full((4,), 0.25), {}, r"must be \[S, 2\]"),
        (np.array([[0.5, 1.0], [0.6, 0.0]]), {}, "encoder column 0 sum to 1.1"),
        (np.array([[1.0, 0.5], [0.0, 0.4]]), {}, "the LLM sum to 0.9"),
        (np.array([[1.5, 1.0], [-0.5, 0.0]]), {}, "finite and >= 0"),
        (np.array([[np.nan, 1.0], [0.0, 0.0]]), {}, "finite and >= 0"),
        ([["a", 1.0]], {}, "numeric"),
    ],
)
def test_bad_shares_are_refused_by_name(shares, kw, match):
    rng = np.random.default_rng(0)
    enc, llm = rng.random(64), rng.random(64)
    with pytest.raises(InvalidInput, match=match):
        assign(enc, llm, np.full(64, 10), dp=2, microbatches=4, stage_shares=shares, **kw)


def test_no_encoder_columns_take_the_llms_shares():
    rng = np.random.default_rng(1)
    llm = rng.random(64)
    a = assign(np.zeros((64, 0)), llm, np.full(64, 10), dp=2, microbatches=4,
               stage_shares=[[0.5], [0.5]])  # fmt: skip
    b = assign(np.zeros((64, 0)), llm, np.full(64, 10), dp=2, microbatches=4, pipeline_stages=2)
    assert _sets(a) == _sets(b)


@pytest.fixture(scope="module")
def plan():
    table = synthesize("qwen2vl-dynamic", 2048, seed=5)
    return make_plan(table, VLA, Cluster(8), 256, pp=2, batches=2, seed=0)


def test_the_planner_records_its_layouts_shares(plan):
    """Measured on the profiled batches: one row per stage, a column per encoder and the
    LLM; they survive the JSON round trip, count in the fingerprint, and a plan whose shares
    do not fit its stages is refused by field name. Both encoders lie wholly on the first
    stage, so they are one cost column. A plan that recorded its shares per encoder group
    (before the per-encoder record) still loads, fingerprint unchanged, and is served as
    before: a column per group."""
    sh = np.asarray(plan.stage_shares)
    assert plan.encoder_groups() == [[0, 1]] and plan.cost_columns() == [[0, 1]]
    assert sh.shape == (plan.pp, len(plan.model_spec().encoders) + 1)
    np.testing.assert_allclose(plan.shares_for(1), sh[:, 1:])
    np.testing.assert_allclose(sh.sum(axis=0), 1.0)
    back = ParallelPlan.from_json(plan.to_json())
    assert back.stage_shares == plan.stage_shares
    assert replace(plan, stage_shares=()).fingerprint() != plan.fingerprint()
    d = json.loads(plan.to_json())
    d["stage_shares"] = [[1.0] * sh.shape[1]] * (plan.pp + 1)
    with pytest.raises(InvalidInput, match="field 'stage_shares'"):
        ParallelPlan.from_dict(d)
    d["stage_shares"] = [[1.0, 0.25], [0.0, 0.75]]  # per group, as written on 2026-11-27
    legacy = ParallelPlan.from_dict(d)
    assert legacy.stage_shares == ((1.0, 0.25), (0.0, 0.75)) and legacy.cost_columns() == [[0, 1]]
    assert legacy.shares_for(1).tolist() == [[1.0, 0.25], [0.0, 0.75]]
    assert legacy.shares_for(2) is None


def test_the_service_passes_the_plans_shares_to_assign(plan):
    """The scheduler hands assign the plan's shares where the source's columns are as many as
    the plan's cost columns; with another number of columns the plan gives none."""
    table = synthesize("qwen2vl-dynamic", 1024, seed=6)
    costs = per_sample_costs(table, plan.model_spec())
    enc = plan.column_costs(costs.encoder_cost())
    assert plan_shares(plan, costs.encoder_cost()) is None  # two columns, the plan has one
    seen = []

    def spy(*args, **kw):
        seen.append(kw.get("stage_shares"))
        return assign(*args, **kw)

    sh = plan_shares(plan, enc)  # what the coordinator passes
    assert np.array_equal(sh, plan.shares_for(enc.shape[1]))
    assert sh is not None and sh.shape == (plan.pp, enc.shape[1] + 1)
    assert plan.shares_for(3) is None and replace(plan, stage_shares=()).shares_for(1) is None
    s = Scheduler(enc, costs.llm_cost(), costs.llm_tokens, dp=plan.dp,
                  microbatches=plan.microbatches, global_batch=plan.global_batch, max_tokens=None,
                  defer_budget=None, method="entrain", seed=0, assign_fn=spy,
                  pipeline_stages=plan.pp, stage_shares=sh)  # fmt: skip
    s.slots(0, 0)
    assert len(seen) == 1 and np.array_equal(seen[0], sh)
