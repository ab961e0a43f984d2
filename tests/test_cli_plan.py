"""``entrain-data plan``: the plan printed and written, pins, one-line errors with exit 2."""

from __future__ import annotations

import json

import pytest

from entrain_data.cli import main
from entrain_data.metadata import write_index
from entrain_data.plan import ParallelPlan
from entrain_data.workloads import synthesize

MODEL = ["--encoder", "siglip-so400m", "--encoder", "whisper-large-v3-encoder"]
MODEL += ["--llm", "llama-3.2-1b"]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "index.parquet"
    write_index(synthesize("vision-audio", 800, seed=0), path)
    return str(path)


def test_plan_prints_and_writes_the_plan(index, tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", index, *MODEL, "--gpus", "16", "--global-batch", "64", "--batches", "2"]
    assert main([*argv, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("layout", "dp=", "microbatches", "token cap", "oracle gap", "worst static"):
        assert word in text
    d = json.loads(out.read_text())
    for key in ("dp", "tp", "pp", "microbatches", "max_tokens", "defer_budget", "stages"):
        assert key in d
    for key in ("expected_iteration_time", "oracle_gap", "schema_version"):
        assert key in d
    assert all(s["module"] and s["layers"] for s in d["stages"])
    plan = ParallelPlan.load(out)
    assert plan.dp * plan.tp * plan.pp == 16
    assert f"llm[{plan.stages[-1].segments[-1].layer_start}:" in text


def test_pins_and_frozen_encoder(index, tmp_path):
    out = tmp_path / "plan.json"
    argv = ["plan", index, *MODEL, "--gpus", "16", "--global-batch", "64", "--batches", "2"]
    argv += ["--pp", "2", "--tp", "2", "--frozen-encoder", "--schedule", "gpipe", "-o", str(out)]
    assert main(argv) == 0
    plan = ParallelPlan.load(out)
    assert (plan.pp, plan.tp, plan.dp, plan.schedule) == (2, 2, 4, "gpipe")
    assert all(e["frozen"] for e in plan.model["encoders"])


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--gpus", "16", "--tp", "3"], "tp=3"),
        (["--gpus", "8", "--gpu-memory-gb", "2"], "fits no layout"),
        (["--gpus", "16", "--llm", "no-such-model"], "no-such-model"),
        (["--gpus", "16", "--global-batch", "100000"], "--global-batch 100000 exceeds"),
        (["--gpus", "0"], "--gpus must be"),
        (["--gpus", "16", "--dp", "0"], "--dp must be a positive integer"),
        (["--gpus", "16", "--max-tokens", "0"], "--max-tokens must be"),
        (["--gpus", "16", "--microbatches", "999"], "(global batch 64, microbatches=999)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(index, tmp_path, capsys, extra, needle):
    argv = ["plan", index, *MODEL, "--global-batch", "64", "--batches", "2"]
    argv += [*extra, "-o", str(tmp_path / "p.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("entrain-data: error:") and needle in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


def test_malformed_index_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    argv = ["plan", str(bad), *MODEL, "--gpus", "8", "--global-batch", "8", "-o", "x.json"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "bad.parquet" in err and len(err.splitlines()) == 1
