"""A corrupted or hand-edited plan file is refused at load with the field named: never a raw
TypeError/ValueError/IndexError, never a plan that loads and fails later in the service."""

from __future__ import annotations

import copy
import json

import pytest

from entrain_data.errors import InvalidInput, PlanError
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment
from entrain_data.presets import ModelSpec

MODEL = ModelSpec.from_names(["siglip-so400m"], "llama-3.2-1b")


def _plan() -> ParallelPlan:
    return ParallelPlan(
        world_size=4,
        gpus_per_node=4,
        dp=2,
        tp=1,
        pp=2,
        stages=(
            StagePlan(
                0,
                (
                    StageSegment("siglip-so400m", 0, 0, 27, True, True),
                    StageSegment("llm", None, 0, 8, True, False),
                ),
            ),
            StagePlan(1, (StageSegment("llm", None, 8, 16, False, True),)),
        ),
        microbatches=4,
        global_batch=16,
        max_tokens=8192,
        defer_budget=1024,
        memory_gb=(10.0, 12.0),
        model=MODEL.to_dict(),
        stage_shares=((1.0, 0.5), (0.0, 0.5)),
    )


def _mutated(path: list, value) -> dict:
    d = copy.deepcopy(_plan().to_dict())
    cur = d
    for k in path[:-1]:
        cur = cur[k]
    if value is KeyError:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return d


CASES = [
    (["stages"], 5, "'stages'"),
    (["stages"], None, "'stages'"),
    (["stages"], [], "'stages'"),
    (["memory_gb"], 3.5, "'memory_gb'"),
    (["memory_gb"], ["a", 1], r"memory_gb\[0\]"),
    (["stages", 0, "segments"], None, r"stages\[0\]: field 'segments'"),
    (
        ["stages", 0, "segments", 0, "layer_start"],
        "a",
        r"stages\[0\].segments\[0\]: field 'layer_start'",
    ),
    (["stages", 0, "segments", 0, "first"], "yes", "field 'first'"),
    (["stages", 0, "segments", 0, "module"], 3, "field 'module'"),
    (["stages", 0, "segments", 0, "layer_end"], KeyError, "missing field.*layer_end"),
    (["stages", 0, "segments", 0], "x", r"segments\[0\] must be an object"),
    (["stages", 0, "index"], "x", "field 'index'"),
    (["stages", 0, "expected_load"], "fast", "field 'expected_load'"),
    (["stages", 0, "recompute"], "no", "field 'recompute'"),
    (["dp"], True, "field 'dp'"),
    (["tp"], 1.0, "field 'tp'"),
    (["max_tokens"], 1e9, "field 'max_tokens'"),
    (["defer_budget"], "1", "field 'defer_budget'"),
    (["stage_shares"], [[1]], "field 'stage_shares'"),
    (["stage_shares"], "x", "field 'stage_shares'"),
    (["stage_shares"], [[1, 0], [0]], "field 'stage_shares'"),
    (["model"], 5, "field 'model'"),
    (["model"], {"x": 1}, "field 'model'"),
    (["schedule"], "zigzag", "field 'schedule'.*1f1b"),
    (["method"], "nope", "field 'method'.*entrain"),
    (["expected_iteration_time"], "x", "field 'expected_iteration_time'"),
    (["oracle_gap"], None, "field 'oracle_gap'"),
    (["recompute"], "yes", "field 'recompute'"),
    (["schema_version"], "2", "field 'schema_version'"),
    (["calibration"], [1], "field 'calibration'"),
    (["search"], [], "field 'search'"),
    (["world_size"], KeyError, "missing field.*world_size"),
    (["gpus_per_node"], 0, "field 'gpus_per_node'"),
    (["gpus_per_node"], KeyError, "missing field.*gpus_per_node"),
    # past the model: the LLM has 16 layers, the plan has one encoder
    (["stages", 1, "segments", 0, "layer_end"], 9999, r"layer_end 9999 is beyond the 16 layers"),
    (["stages", 0, "segments", 0, "encoder_index"], 7, "encoder_index 7"),
]


@pytest.mark.parametrize(("path", "value", "needle"), CASES, ids=[str(c[:2]) for c in CASES])
def test_bad_field_is_refused_at_load_naming_it(tmp_path, path, value, needle):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(_mutated(path, value)))
    with pytest.raises(InvalidInput, match=needle) as err:
        ParallelPlan.load(f)
    assert str(f) in str(err.value)
    assert "\n" not in str(err.value)


def test_layers_past_the_model_are_a_plan_error():
    with pytest.raises(PlanError, match="beyond the 16 layers of 'llama-3.2-1b'"):
        ParallelPlan.from_dict(_mutated(["stages", 1, "segments", 0, "layer_end"], 17))


def test_a_good_plan_round_trips_and_keeps_its_fingerprint(tmp_path):
    plan = _plan()
    back = ParallelPlan.load(plan.save(tmp_path / "plan.json"))
    assert back == plan and back.fingerprint() == plan.fingerprint()
    assert StagePlan.from_dict(plan.stages[0].to_dict()) == plan.stages[0]


def test_non_utf8_plan_file_names_the_file(tmp_path):
    f = tmp_path / "plan.json"
    f.write_bytes(b"\xff\xfe{not json")
    with pytest.raises(InvalidInput, match="plan.json: not a UTF-8"):
        ParallelPlan.load(f)


def test_value_types_refuse_bad_fields_when_built_in_code():
    with pytest.raises(InvalidInput, match="field 'layer_end'"):
        StageSegment("llm", None, 0, "4", True, True)
    with pytest.raises(InvalidInput, match="field 'schedule'"):
        ParallelPlan(**{**_plan().__dict__, "schedule": "zigzag"})
