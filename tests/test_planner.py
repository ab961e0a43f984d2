"""Static planner and plan value types: layout invariants, pins, memory, JSON, rank coordinates."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from entrain_data.errors import InvalidInput, PlanError
from entrain_data.plan import PLAN_SCHEMA_VERSION, Cluster, ParallelPlan
from entrain_data.plan_layout import memory_gb, split_chain
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.profiler import macro_profile
from entrain_data.workloads import synthesize


@pytest.fixture(scope="module")
def table():
    return synthesize("vision-audio", 1500, seed=0)


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_names(["siglip-so400m", "whisper-large-v3-encoder"], "llama-3.2-1b")


@pytest.fixture(scope="module")
def plan(table, spec):
    return make_plan(table, spec, Cluster(16), 64, batches=4, seed=0)


def _layers_covered(plan: ParallelPlan, spec: ModelSpec) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for st in plan.stages:
        for seg in st.segments:
            out.setdefault(seg.module, []).extend(range(seg.layer_start, seg.layer_end))
    return out


def test_plan_is_a_consistent_layout(plan, spec):
    assert plan.dp * plan.tp * plan.pp == 16
    assert len(plan.stages) == plan.pp
    assert plan.global_batch % plan.dp == 0
    assert plan.global_batch >= plan.dp * plan.microbatches
    # every layer of every module is on exactly one stage, in order, encoders before the LLM
    covered = _layers_covered(plan, spec)
    assert covered[spec.llm.name if "llm" not in covered else "llm"] == list(range(spec.llm.layers))
    for enc in spec.encoders:
        assert covered[enc.name] == list(range(enc.layers))
    kinds = [seg.kind for st in plan.stages for seg in st.segments]
    assert kinds == sorted(kinds, key=lambda k: k == "llm")
    assert plan.max_tokens >= 1 and plan.defer_budget >= 0
    assert all(m <= 0.9 * 80 for m in plan.memory_gb)
    assert plan.oracle_gap >= -1e-12 and 0.0 <= plan.worst_static_gap < 1.0
    assert plan.expected_iteration_time >= plan.ideal_iteration_time * (1 - 1e-9) > 0
    assert all(st.expected_load > 0 for st in plan.stages)


def test_token_cap_admits_every_sample(table, spec, plan):
    from entrain_data.cost_model import per_sample_costs

    assert per_sample_costs(table, spec).llm_tokens.max() <= plan.max_tokens


def test_plan_is_deterministic_for_a_seed(table, spec, plan):
    again = make_plan(table, spec, Cluster(16), 64, batches=4, seed=0)
    assert again.to_dict() | {"search": {}} == plan.to_dict() | {"search": {}}


def test_json_round_trip_and_file(plan, tmp_path):
    back = ParallelPlan.from_json(plan.to_json())
    assert back == plan
    d = json.loads(plan.to_json())
    for key in (
        "dp",
        "tp",
        "pp",
        "microbatches",
        "max_tokens",
        "defer_budget",
        "stages",
        "expected_iteration_time",
        "oracle_gap",
        "worst_static_gap",
        "schema_version",
    ):
        assert key in d
    assert d["schema_version"] == PLAN_SCHEMA_VERSION
    assert all("module" in s and "layers" in s for s in d["stages"])
    path = plan.save(tmp_path / "sub" / "plan.json")
    assert ParallelPlan.load(path) == plan
    assert plan.model_spec() == ModelSpec.from_dict(plan.model)


def test_load_rejects_bad_files(plan, tmp_path):
    with pytest.raises(InvalidInput, match="not found"):
        ParallelPlan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInput, match="bad.json"):
        ParallelPlan.load(bad)
    d = plan.to_dict()
    del d["max_tokens"]
    bad.write_text(json.dumps(d))
    with pytest.raises(InvalidInput, match="max_tokens"):
        ParallelPlan.load(bad)
    newer = plan.to_dict() | {"schema_version": PLAN_SCHEMA_VERSION + 1}
    with pytest.raises(InvalidInput, match="schema version"):
        ParallelPlan.from_dict(newer)


def test_value_types_validate():
    with pytest.raises(InvalidInput, match="world_size"):
        Cluster(0)
    with pytest.raises(InvalidInput, match="gpu_memory_gb"):
        Cluster(8, gpu_memory_gb=-1)


def test_rank_coords_follow_megatron_order(plan):
    p = replace(plan, world_size=16, dp=2, tp=2, pp=4, stages=plan.stages[:1] * 4, stage_shares=())
    coords = [p.rank_coords(r) for r in range(16)]
    assert len({(c.replica, c.stage, c.tp_rank) for c in coords}) == 16
    assert [c.tp_rank for c in coords[:4]] == [0, 1, 0, 1]  # tp fastest
    assert [c.replica for c in coords[:4]] == [0, 0, 1, 1]  # then dp
    assert [c.stage for c in coords[::4]] == [0, 1, 2, 3]  # then pp
    assert sorted(p.ranks_of_replica(1)) == [r for r, c in enumerate(coords) if c.replica == 1]
    with pytest.raises(InvalidInput, match="rank 16"):
        p.rank_coords(16)


@pytest.mark.parametrize(("pins", "expect"), [({"pp": 4}, {"pp": 4}), ({"tp": 2}, {"tp": 2})])
def test_pins_are_honoured(table, spec, pins, expect):
    p = make_plan(table, spec, Cluster(16), 64, batches=2, **pins)
    for k, v in expect.items():
        assert getattr(p, k) == v
    assert p.dp * p.tp * p.pp == 16


def test_pinned_dp_and_microbatches(table, spec):
    p = make_plan(table, spec, Cluster(16), 64, batches=2, dp=4, microbatches=8)
    assert (p.dp, p.microbatches) == (4, 8)
    assert p.tp * p.pp == 4


def test_impossible_pins_name_the_problem(table, spec):
    with pytest.raises(PlanError, match="tp=3"):
        make_plan(table, spec, Cluster(16), 64, batches=2, tp=3)
    with pytest.raises(PlanError, match="attention heads"):
        make_plan(table, spec, Cluster(24), 48, batches=2, tp=6)
    with pytest.raises(PlanError, match="dp=5"):
        make_plan(table, spec, Cluster(16), 64, batches=2, dp=5)
    with pytest.raises(InvalidInput, match="global_batch"):
        make_plan(table, spec, Cluster(16), 10**6, batches=2)
    with pytest.raises(InvalidInput, match="microbatches"):
        make_plan(table, spec, Cluster(16), 64, batches=2, microbatches=0)


def test_model_that_fits_no_layout_says_how_much_memory(table):
    big = ModelSpec.from_names(["siglip-so400m", "whisper-large-v3-encoder"], "llama-3.1-70b")
    with pytest.raises(PlanError, match=r"fits no layout of 8 GPUs: the smallest needs [\d.]+ GB"):
        make_plan(table, big, Cluster(8, gpu_memory_gb=40), 64, batches=2)
    # the same model fits when the cluster is large enough to shard it
    p = make_plan(table, big, Cluster(64, gpu_memory_gb=80), 64, batches=2)
    assert max(p.memory_gb) <= 0.9 * 80


def test_one_very_long_sample_is_named_where_it_sets_the_token_cap():
    """It said only "fits no layout ... the smallest needs 147.8 GB", which reads as a model too
    big; a pinned cap named the sample (k7), the derived one did not."""
    from entrain_data.metadata import SampleMeta, SampleTable

    recs = [SampleMeta(f"k{i}", "t.parquet", 60, row=i) for i in range(64)]
    recs[7] = SampleMeta("k7", "t.parquet", 200_000, row=7)
    long = SampleTable.from_records(recs, origin="t.parquet")
    llm = ModelSpec.from_names([], "llama-3.2-1b")
    with pytest.raises(PlanError, match=r"fits no layout of 2 GPUs") as exc:
        make_plan(long, llm, Cluster(2), 8, batches=2)
    msg = str(exc.value)
    assert "longest samples: k7 (200000 tokens); pin a smaller cap with max_tokens" in msg
    assert "k6" not in msg
    # a model too big for any cap names no sample: the samples are not the cause
    big = ModelSpec.from_names(["siglip-so400m", "whisper-large-v3-encoder"], "llama-3.1-70b")
    with pytest.raises(PlanError, match="fits no layout") as exc:
        make_plan(
            synthesize("vision-audio", 800, seed=0),
            big,
            Cluster(8, gpu_memory_gb=40),
            64,
            batches=2,
        )
    assert "longest samples" not in str(exc.value)


def test_frozen_encoder_needs_less_memory_and_time(table, spec):
    pins = {"dp": 4, "tp": 1, "pp": 4, "microbatches": 8}
    live = make_plan(table, spec, Cluster(16), 64, batches=2, **pins)
    frozen = make_plan(table, spec, Cluster(16), 64, batches=2, frozen_encoder=True, **pins)
    assert all(e["frozen"] for e in frozen.model["encoders"])
    assert frozen.expected_iteration_time < live.expected_iteration_time
    frozen_spec = frozen.model_spec()
    args = (live.stages, 1, 4, 8, live.max_tokens, 1000, live.defer_budget)
    # on the same stages, frozen encoder weights carry no gradients or optimizer state
    assert memory_gb(frozen_spec, *args)[0] < memory_gb(spec, *args)[0]
    assert memory_gb(frozen_spec, *args)[-1] == pytest.approx(memory_gb(spec, *args)[-1])


def test_profile_batches_are_used(table, spec):
    prof = macro_profile(table, spec, 64, batches=3, seed=5)
    p = make_plan(table, spec, Cluster(16), None, profile=prof)
    assert p.global_batch == 64 and p.search["profiled_batches"] == 3
    with pytest.raises(InvalidInput, match="differs"):
        make_plan(table, spec, Cluster(16), 32, profile=prof)


def test_split_chain_balances_the_largest_group():
    costs = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    cuts = split_chain(costs, 3)
    bounds = [0, *cuts]
    sums = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert cuts[-1] == len(costs) and len(cuts) == 3
    assert sums == [5.0, 5.0, 5.0]  # the optimum: the two heavy ends alone
    assert split_chain(costs, 8) is None


def test_memory_grows_with_microbatches_in_flight(plan, spec):
    st = plan.stages
    few = memory_gb(spec, st, 1, plan.dp, 1, plan.max_tokens, 1000, plan.defer_budget)
    many = memory_gb(spec, st, 1, plan.dp, 8, plan.max_tokens, 1000, plan.defer_budget)
    assert all(a <= b for a, b in zip(few, many))
    sharded = memory_gb(spec, st, 1, plan.dp * 4, 1, plan.max_tokens, 1000, plan.defer_budget)
    assert all(a < b for a, b in zip(sharded, few))  # ZeRO-1: optimizer state over dp


def test_static_plan_is_close_to_the_per_batch_oracle(table, spec):
    p = make_plan(table, spec, Cluster(32), 256, batches=4, seed=1)
    assert p.oracle_gap <= 0.02
    times = np.array([s["batch_times"] for s in p.search["simulated"]], dtype=float)
    full = ~np.isnan(times).any(axis=1)
    assert p.expected_iteration_time == pytest.approx(times[full].mean(axis=1).min())
    oracle = np.nanmin(times, axis=0).mean()
    assert p.oracle_gap == pytest.approx(p.expected_iteration_time / oracle - 1)


def test_gpipe_keeps_every_microbatch_in_flight(plan, spec):
    args = (plan.stages, 1, plan.dp, 8, plan.max_tokens, 1000, plan.defer_budget)
    one_f_one_b = memory_gb(spec, *args)
    gpipe = memory_gb(spec, *args, schedule="gpipe")
    assert all(g >= o for g, o in zip(gpipe, one_f_one_b))
    assert gpipe[-1] > one_f_one_b[-1]  # the last stage holds 1 microbatch under 1F1B, 8 here


def test_rank_coords_unpack_as_a_tuple(plan):
    replica, stage, tp_rank = plan.rank_coords(plan.world_size - 1)
    assert (replica, stage, tp_rank) == (plan.dp - 1, plan.pp - 1, plan.tp - 1)


def _stage_plan(stages: list[list[tuple[str, int | None]]]) -> ParallelPlan:
    from entrain_data.plan import StagePlan, StageSegment

    sp = tuple(
        StagePlan(i, tuple(StageSegment(name, e, 0, 1, True, True) for name, e in segs))
        for i, segs in enumerate(stages)
    )
    return ParallelPlan(
        world_size=len(sp), gpus_per_node=8, dp=1, tp=1, pp=len(sp), stages=sp,
        microbatches=4, global_batch=8, max_tokens=4096, defer_budget=4096,
    )  # fmt: skip


def test_encoder_groups_follow_shared_stages() -> None:
    """Encoders that share a stage form a group; a shared stage links a chain."""
    one_stage = _stage_plan([[("vit", 0), ("whisper", 1), ("video", 2), ("llm", None)]])
    assert one_stage.encoder_groups() == [[0, 1, 2]]
    apart = _stage_plan([[("vit", 0)], [("whisper", 1), ("llm", None)], [("video", 2)]])
    assert apart.encoder_groups() == [[0], [1], [2]]
    chained = _stage_plan([[("vit", 0), ("whisper", 1)], [("whisper", 1), ("video", 2)]])
    assert chained.encoder_groups() == [[0, 1, 2]]  # a shared stage links the chain
    mixed = _stage_plan([[("vit", 0)], [("video", 2), ("llm", None)], [("whisper", 1)]])
    assert mixed.encoder_groups() == [[0], [1], [2]]
    text_only = _stage_plan([[("llm", None)]])
    assert text_only.encoder_groups() == []
