"""``entrain-data plan`` pins sharding, recomputation and the cluster's bandwidths; the plan prints them."""

from __future__ import annotations

import pytest

from entrain_data.cli import main
from entrain_data.errors import InvalidInput, PlanError
from entrain_data.metadata import write_index
from entrain_data.plan import Cluster, ParallelPlan
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.workloads import synthesize

MODEL = ["--encoder", "siglip-so400m", "--llm", "llama-3.2-1b"]
SPEC = ModelSpec.from_names(["siglip-so400m"], "llama-3.2-1b")


@pytest.fixture(scope="module")
def table():
    return synthesize("llava-fixed", 600, seed=0)


@pytest.fixture(scope="module")
def index(tmp_path_factory, table):
    path = tmp_path_factory.mktemp("plan") / "index.parquet"
    write_index(table, path)
    return str(path)


def _plan(index, tmp_path, *extra):
    out = tmp_path / "plan.json"
    argv = ["plan", index, *MODEL, "--gpus", "16", "--global-batch", "64", "--batches", "2"]
    assert main([*argv, *extra, "-o", str(out)]) == 0
    return ParallelPlan.load(out)


def test_pinned_sharding_and_recompute_reach_the_plan_and_its_print(index, tmp_path, capsys):
    plan = _plan(index, tmp_path, "--sharding", "full", "--recompute", "always")
    text = capsys.readouterr().out
    assert plan.sharding == "full"
    assert plan.recompute and all(s.recompute for s in plan.stages)
    assert "sharding     full (ZeRO-3" in text
    every = ", ".join(str(s.index) for s in plan.stages)
    assert f"recompute    stages {every}" in text
    stage_lines = [ln for ln in text.splitlines() if " load/microbatch " in ln]
    assert len(stage_lines) == len(plan.stages)
    assert all(ln.endswith("  recompute") for ln in stage_lines)


def test_default_lets_the_planner_choose_and_prints_its_choice(index, tmp_path, capsys):
    plan = _plan(index, tmp_path)
    text = capsys.readouterr().out
    assert f"sharding     {plan.sharding}" in text
    rc = [s.index for s in plan.stages if s.recompute]
    assert ("recompute    none" in text) == (not rc)
    none = _plan(index, tmp_path, "--sharding", "none", "--recompute", "never")
    assert none.sharding == "none" and not any(s.recompute for s in none.stages)


def test_recompute_never_refuses_a_model_that_needs_it(table):
    # 12 GB GPUs: the 1B LLM's weights fit on 4 pipeline stages, its activations only
    # recomputed (was 8 GB before the memory model counted the last stage's LM-head logits
    # and fp32 loss tensors, ~7.7 GB at this token cap, which no recomputation frees)
    kw = dict(batches=2, seed=0, dp=2, pp=4, tp=1, microbatches=8)
    small = Cluster(8, gpu_memory_gb=12.0)
    plan = make_plan(table, SPEC, small, 64, recompute="stage", **kw)
    assert any(s.recompute for s in plan.stages)
    assert not all(s.recompute for s in plan.stages) or len(plan.stages) == 1
    with pytest.raises(PlanError):
        make_plan(table, SPEC, small, 64, recompute="never", **kw)
    with pytest.raises(InvalidInput, match="recompute 'sometimes'"):
        make_plan(table, SPEC, small, 64, recompute="sometimes", **kw)


def test_slower_network_makes_sharded_plans_slower(table):
    kw = dict(batches=2, seed=0, dp=16, pp=1, tp=1, microbatches=4, shardings=("full",))
    fast = make_plan(table, SPEC, Cluster(16, inter_node_gbps=50.0), 64, **kw)
    slow = make_plan(table, SPEC, Cluster(16, inter_node_gbps=0.5), 64, **kw)
    assert slow.expected_iteration_time > fast.expected_iteration_time


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--inter-node-gbps", "0"], "--inter-node-gbps"),  # the flag, not the Python name
        (["--intra-node-gbps", "-1"], "--intra-node-gbps"),
    ],
)
def test_bad_bandwidth_is_one_line_and_exit_2(index, tmp_path, capsys, extra, needle):
    argv = ["plan", index, *MODEL, "--gpus", "16", "--global-batch", "64", "--batches", "2"]
    assert main([*argv, *extra, "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_bad_sharding_choice_is_exit_2(index, tmp_path):
    argv = ["plan", index, *MODEL, "--gpus", "16", "--global-batch", "64"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--sharding", "zero3", "-o", str(tmp_path / "p.json")])
    assert e.value.code == 2
