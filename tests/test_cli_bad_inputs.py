"""Bad input to the core commands: one line ``entrain-data: error: ...`` naming the file, line or
field, exit 2, and for an output path that cannot be written, before the work is done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entrain_data.cli import build_parser, main
from entrain_data.errors import InvalidInput
from entrain_data.metadata import write_index
from entrain_data.plan import ParallelPlan
from entrain_data.presets import load_module
from entrain_data.workloads import synthesize

MODEL = ["--encoder", "qwen2.5-vl-vision", "--llm", "llama-3.2-1b"]


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    table = synthesize("qwen2vl-dynamic", 200, seed=0)
    return write_index(table, tmp_path_factory.mktemp("idx") / "t.parquet")


@pytest.fixture(scope="module")
def keys(index) -> list[str]:
    from entrain_data.metadata import read_index

    return [str(k) for k in read_index(index).keys[:3]]


def _one_line_exit_2(argv: list[str], capsys, *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("entrain-data: error: ") and "\n" not in err, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture()
def a_file(tmp_path) -> Path:
    f = tmp_path / "file.txt"
    f.write_text("x")
    return f


def test_plan_to_an_unwritable_path_fails_before_planning(tmp_path, a_file, capsys):
    """The index does not even exist: the output path is checked first."""
    out = a_file / "plan.json"
    argv = ["plan", str(tmp_path / "missing.parquet"), *MODEL, "--gpus", "8"]
    _one_line_exit_2(argv + ["--global-batch", "64", "-o", str(out)], capsys, str(out), "folder")
    _one_line_exit_2(argv + ["--global-batch", "64", "-o", str(tmp_path)], capsys, "is a folder")


def test_profile_outputs_are_checked_before_profiling(tmp_path, a_file, capsys):
    base = ["profile", str(tmp_path / "missing.parquet"), *MODEL, "--batches", "2"]
    _one_line_exit_2(base + ["--json", str(a_file / "p.json")], capsys, "--json", "p.json")
    _one_line_exit_2(base + ["--png", str(a_file / "p.png")], capsys, "--png", "p.png")


def test_calibrate_output_is_checked_before_fitting(tmp_path, a_file, capsys):
    argv = ["calibrate", str(tmp_path / "missing.parquet"), str(tmp_path / "m.jsonl"), *MODEL]
    _one_line_exit_2(argv + ["-o", str(a_file / "cal.json")], capsys, "calibration", "cal.json")


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"seconds": "fast"}, "field 'seconds'"),
        ({"seconds": -1.0}, "field 'seconds'"),
        ({"seconds": True}, "field 'seconds'"),
        ({"keys": 5}, "field 'keys'"),
        ({"keys": []}, "field 'keys'"),
        ({"keys": [[1, 2]]}, "field 'keys'"),
        ({"module": 3}, "field 'module'"),
        ({"module": "nonexistent"}, "field 'module'"),
        ({"phase": "sideways"}, "field 'phase'"),
    ],
)
def test_calibrate_names_the_line_and_field_of_a_bad_measurement(
    index, keys, tmp_path, capsys, fields, needle
):
    good = {"module": "llm", "seconds": 0.1, "keys": keys}
    meas = tmp_path / "m.jsonl"
    meas.write_text(json.dumps(good) + "\n" + json.dumps({**good, **fields}) + "\n")
    argv = ["calibrate", str(index), str(meas), *MODEL, "-o", str(tmp_path / "cal.json")]
    _one_line_exit_2(argv, capsys, f"{meas}:2:", needle)


@pytest.mark.parametrize("role", ["--encoder", "--llm"])
def test_non_utf8_model_config_names_the_path(index, tmp_path, capsys, role):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00{")
    model = {"--encoder": "qwen2.5-vl-vision", "--llm": "llama-3.2-1b", role: str(bad)}
    argv = ["profile", str(index), "--global-batch", "16", "--batches", "2"]
    argv += ["--encoder", model["--encoder"], "--llm", model["--llm"]]
    _one_line_exit_2(argv, capsys, str(bad), "UTF-8")


@pytest.mark.parametrize(
    ("module", "change", "needle"),
    [
        ("qwen2.5-vl-vision", {"full_attention_layers": "7"}, "'full_attention_layers'"),
        ("qwen2.5-vl-vision", {"full_attention_layers": ["7"]}, "'full_attention_layers'"),
        ("qwen2.5-vl-vision", {"window_patches": -8}, "'window_patches'"),
        ("qwen2.5-vl-vision", {"video_total_pixels": -1}, "'video_total_pixels'"),
        ("qwen2.5-vl-vision", {"min_pixels": "3136"}, "'min_pixels'"),
        ("qwen2.5-vl-vision", {"image_mean": "0.5"}, "'image_mean'"),
        ("qwen2.5-vl-vision", {"gated_mlp": "yes"}, "'gated_mlp'"),
        ("llama-3.2-1b", {"hidden": True}, "'hidden'"),
        ("llama-3.2-1b", {"vocab": "x"}, "'vocab'"),
    ],
)
def test_bad_module_config_field_is_named(index, tmp_path, capsys, module, change, needle):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**load_module(module).to_dict(), **change}))
    role = "--llm" if module.startswith("llama") else "--encoder"
    model = {"--encoder": "qwen2.5-vl-vision", "--llm": "llama-3.2-1b", role: str(cfg)}
    argv = ["profile", str(index), "--global-batch", "16", "--batches", "2"]
    argv += ["--encoder", model["--encoder"], "--llm", model["--llm"]]
    _one_line_exit_2(argv, capsys, str(cfg), needle)


def test_serve_with_a_malformed_plan_is_one_line_and_exit_2(index, tmp_path, capsys):
    """README: a bad --plan is one line and exit 2 (it was a TypeError traceback, exit 1)."""
    if "serve" not in build_parser().format_help():
        pytest.skip("the serve command is not installed")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"world_size": 1, "gpus_per_node": 1, "dp": 1, "tp": 1, "pp": 1,
                               "stages": 5, "microbatches": 1, "global_batch": 1,
                               "max_tokens": 1, "defer_budget": 0}))  # fmt: skip
    with pytest.raises(InvalidInput, match="field 'stages'"):
        ParallelPlan.load(bad)
    _one_line_exit_2(["serve", "--index", str(index), "--plan", str(bad)], capsys, "'stages'")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--gpu-memory-gb", "inf"], "--gpu-memory-gb"),
        (["--inter-node-gbps", "nan"], "--inter-node-gbps"),
        (["--max-delay", "-1"], "--max-delay"),
    ],
)
def test_plan_refuses_infinite_cluster_numbers_and_negative_delay(
    index, tmp_path, capsys, extra, needle
):
    argv = ["plan", str(index), *MODEL, "--gpus", "8", "--global-batch", "16", "--batches", "1"]
    _one_line_exit_2([*argv, *extra, "-o", str(tmp_path / "p.json")], capsys, needle)
    assert not (tmp_path / "p.json").exists()


def _commands_with(dest: str) -> list[str]:
    """Every installed command with an option of this dest (plugins' too)."""
    sub = build_parser()._subparsers._group_actions[0]
    return sorted(n for n, p in sub.choices.items() if any(a.dest == dest for a in p._actions))


def test_every_seed_option_is_found():  # the parametrisation below is not empty by accident
    assert {"plan", "profile", "synth"} <= set(_commands_with("seed"))


@pytest.mark.parametrize("command", _commands_with("seed"))
def test_a_negative_seed_is_one_line_and_exit_2_in_every_command(command, capsys):
    """plan and profile crashed with numpy's traceback (rc 1); serve accepted it."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--seed", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"entrain-data {command}: error: argument --seed: must be an integer >= 0, got -1"


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_serve_refuses_a_stats_interval_that_is_not_seconds(value, capsys):
    if "serve" not in _commands_with("stats_interval"):
        pytest.skip("the serve command is not installed")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--index", "i", "--plan", "p", "--stats-interval", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("entrain-data serve: error: argument --stats-interval: ") and "\n" not in err
    )
