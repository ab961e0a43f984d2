"""A simulated layout whose token cap cannot serve a profiled batch is dropped, not a crash.

text-heavy on 1024 GPUs with global batch 8192 gives each replica 8 samples; with one microbatch
the cap (a replica's share of the heaviest batch plus one sample) is below what the cost-balanced
assignment hands some replica, so the assignment refuses that (dp, M). Before, that refusal
escaped make_plan from inside the simulation (bench/plan.py with qwen2.5-7b died on it).
"""

from __future__ import annotations

import pytest

from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import PlanError
from entrain_data.plan import Cluster
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.workloads import synthesize


@pytest.fixture(scope="module")
def setting():
    table = synthesize("text-heavy", 40000, seed=0)
    model = ModelSpec.from_names(["qwen2.5-vl-vision"], "qwen2.5-7b")
    return table, model, per_sample_costs(table, model)


def _plan(setting, **kw):
    table, model, costs = setting
    return make_plan(table, model, Cluster(1024), 8192, batches=8, seed=0, costs=costs, **kw)


def test_only_unservable_layouts_is_a_plan_error_naming_the_cap(setting):
    with pytest.raises(PlanError, match="token cap serves every profiled batch.*max_tokens="):
        _plan(setting, dp=1024, microbatches=1, shardings=("optimizer",), recompute="all")


@pytest.mark.slow
def test_unservable_layouts_are_dropped_from_the_search(setting):
    plan = _plan(setting, dp=1024, shardings=("optimizer",), recompute="all")
    assert plan.microbatches > 1
    assert all(x["microbatches"] > 1 for x in plan.search["simulated"])
