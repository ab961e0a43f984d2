"""Sharding and per-stage recomputation in the plan: the field, the memory and time models, the
planner's choice, and what the adapters make of them."""

from __future__ import annotations

import dataclasses
import time

import pytest

from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput
from entrain_data.plan import SHARDING, Cluster, ParallelPlan, StagePlan, StageSegment
from entrain_data.plan_layout import memory_gb, stage_params
from entrain_data.plan_time import gather_times, sync_time
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.workloads import synthesize


def _plan(**kw: object) -> ParallelPlan:
    stages = tuple(
        StagePlan(i, (StageSegment("llm", None, 2 * i, 2 * i + 2, i == 0, i == 1),), 0.0, i == 1)
        for i in range(2)
    )
    base = dict(
        world_size=4, gpus_per_node=8, dp=2, tp=1, pp=2, stages=stages, microbatches=2,
        global_batch=16, max_tokens=4096, defer_budget=0,
    )  # fmt: skip
    base.update(kw)
    return ParallelPlan(**base)


def test_plan_round_trip_and_validation() -> None:
    plan = _plan(sharding="full")
    back = ParallelPlan.from_json(plan.to_json())
    assert back.sharding == "full" and [s.recompute for s in back.stages] == [False, True]
    assert ParallelPlan.from_dict({**plan.to_dict(), "sharding": "none"}).sharding == "none"
    old = plan.to_dict()
    del old["sharding"]
    for st in old["stages"]:
        del st["recompute"]
    legacy = ParallelPlan.from_dict(old)  # plans written before the fields
    assert legacy.sharding == "optimizer" and not any(s.recompute for s in legacy.stages)
    with pytest.raises(InvalidInput, match="'sharding'"):
        _plan(sharding="zero3")


def test_memory_and_traffic_per_sharding() -> None:
    model = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.1-8b")
    plan = _plan()
    params = [stage_params(model, st) for st in plan.stages]
    mem = {
        sh: memory_gb(model, plan.stages, 1, 64, 8, 8192, 4096, 0, False, params, "1f1b", sh)
        for sh in SHARDING
    }
    for s in range(2):
        assert mem["full"][s] < mem["optimizer"][s] < mem["none"][s]
        assert mem["gradients"][s] == mem["optimizer"][s]  # the adapters hold the whole grad
    rc = memory_gb(model, plan.stages, 1, 64, 8, 8192, 4096, 0, [False, True], params)
    assert rc[0] == mem["optimizer"][0] and rc[1] < mem["optimizer"][1]
    cl = Cluster(128)
    assert sync_time(params, 1, 64, cl, "full") == pytest.approx(
        sync_time(params, 1, 64, cl, "optimizer") / 2
    )
    assert gather_times(params, 1, 64, cl, "optimizer").sum() == 0
    assert (gather_times(params, 1, 64, cl, "full") > 0).all()


@pytest.fixture(scope="module")
def planned() -> dict:
    """An 8B LLM on 64 GPUs of 40 GB: memory is tight, so sharding and recomputation matter."""
    table = synthesize("qwen2vl-dynamic", 3000, seed=0)
    model = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.1-8b")
    costs = per_sample_costs(table, model)
    cluster = Cluster(64, gpu_memory_gb=40.0)
    kw = dict(batches=2, seed=0, costs=costs, simulate_top=2)
    t0 = time.perf_counter()
    new = make_plan(table, model, cluster, 256, **kw)
    old = make_plan(table, model, cluster, 256, shardings=("optimizer",), recompute="all", **kw)
    return {"new": new, "old": old, "seconds": time.perf_counter() - t0}


def test_planner_scores_sharding_and_recompute(planned: dict) -> None:
    new, old = planned["new"], planned["old"]
    assert new.expected_iteration_time <= old.expected_iteration_time * (1 + 1e-9)
    assert {x["sharding"] for x in new.search["simulated"]} - {"optimizer"}, (
        "no other sharding reached the simulation: the choice was not scored"
    )
    assert max(new.memory_gb) <= 0.9 * 40.0
    assert new.recompute == any(s.recompute for s in new.stages)
    with pytest.raises(InvalidInput, match="shardings"):
        make_plan(
            synthesize("qwen2vl-dynamic", 100, seed=0),
            ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.1-8b"),
            Cluster(8),
            16,
            shardings=("zero3",),
        )


def test_deepspeed_config_applies_sharding() -> None:
    from entrain_data.adapters.deepspeed import deepspeed_config

    for sh, stage in zip(SHARDING, (0, 1, 2, 3)):
        cfg = deepspeed_config(_plan(sharding=sh))
        assert cfg["zero_optimization"]["stage"] == stage
    kept = deepspeed_config(_plan(sharding="full"), {"zero_optimization": {"stage": 2}})
    assert kept["zero_optimization"]["stage"] == 2  # the user's, with a warning


def test_megatron_settings_apply_recompute_and_sharding() -> None:
    pytest.importorskip("megatron.core")
    from entrain_data.adapters.megatron import ddp_settings, transformer_settings

    plan = _plan()
    assert "recompute_granularity" not in transformer_settings(plan, stage=0)
    assert transformer_settings(plan, stage=1)["recompute_granularity"] == "full"
    assert "recompute_granularity" not in transformer_settings(plan)  # not every stage
    every = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, recompute=True) for s in plan.stages)
    )
    assert transformer_settings(every)["recompute_method"] == "uniform"
    assert ddp_settings(plan)["use_distributed_optimizer"]
    assert not ddp_settings(_plan(sharding="none"))["use_distributed_optimizer"]
    with pytest.raises(InvalidInput, match="FSDP"):
        ddp_settings(_plan(sharding="full"))
