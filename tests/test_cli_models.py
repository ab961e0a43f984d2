"""``entrain-data models | synth | profile``: output, files written, one-line errors with exit 2."""

from __future__ import annotations

import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entrain_data import cli_models
from entrain_data.errors import EntrainError
from entrain_data.metadata import read_index

HAVE_FULL_CLI = importlib.util.find_spec("entrain_data.cli_plan") is not None


def _main(argv: list[str]) -> int:
    """``entrain_data.cli.main`` once every core command exists; until then the same parser class
    and error handling with only this module's commands registered."""
    if HAVE_FULL_CLI:
        from entrain_data.cli import main

        return main(argv)
    from entrain_data.cli import _Parser

    parser = _Parser(prog="entrain-data")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True
    cli_models.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except EntrainError as exc:
        import sys

        print(f"entrain-data: error: {exc}", file=sys.stderr)
        return 2


def test_models_lists_required_presets(capsys):
    assert _main(["models"]) == 0
    out = capsys.readouterr().out
    for name in (
        "qwen2.5-vl-vision",
        "siglip-so400m",
        "internvit-300m",
        "whisper-large-v3-encoder",
        "llama-3.2-1b",
        "llama-3.2-3b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "qwen2.5-72b",
    ):
        assert name in out
    assert "14336" in out  # Llama-3.1-8B's FFN size
    assert _main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["llama-3.1-8b"]["kv_heads"] == 8


def test_synth_list_and_write(tmp_path, capsys):
    assert _main(["synth", "--list"]) == 0
    out = capsys.readouterr().out
    for name in (
        "llava-fixed",
        "qwen2vl-dynamic",
        "multi-image-video",
        "vision-audio",
        "text-heavy",
    ):
        assert name in out
    idx = tmp_path / "va.parquet"
    assert _main(["synth", "vision-audio", "--samples", "600", "--seed", "5", "-o", str(idx)]) == 0
    t = read_index(idx)
    assert len(t) == 600 and len(t.audio_seconds) > 0


def test_profile_prints_table_png_and_json(tmp_path, capsys):
    idx = tmp_path / "va.parquet"
    assert _main(["synth", "vision-audio", "--samples", "2000", "-o", str(idx)]) == 0
    png, js = tmp_path / "cv.png", tmp_path / "p.json"
    argv = [
        "profile",
        str(idx),
        "--encoder",
        "qwen2.5-vl-vision",
        "--encoder",
        "whisper-large-v3-encoder",
    ]
    argv += [
        "--llm",
        "llama-3.2-1b",
        "--global-batch",
        "256",
        "--batches",
        "8",
        "--png",
        str(png),
        "--json",
        str(js),
    ]
    assert _main(argv) == 0
    out = capsys.readouterr().out
    assert "whisper-large-v3-encoder" in out and "encoder:LLM" in out and "batch CV" in out
    assert png.stat().st_size > 1000
    d = json.loads(js.read_text())
    assert d["global_batch"] == 256 and len(d["batch_indices"]) == 8
    # frozen encoders: forward only, so the encoder share drops
    assert _main(argv[:-4] + ["--frozen-encoder"]) == 0


def _expect_error(argv, capsys, *needles):
    assert _main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("entrain-data: error:") and "\n" not in err and "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_bad_input_one_line_exit_2(tmp_path, capsys):
    idx = tmp_path / "t.parquet"
    assert _main(["synth", "llava-fixed", "--samples", "300", "-o", str(idx)]) == 0
    capsys.readouterr()
    _expect_error(
        ["profile", str(idx), "--encoder", "nope-vit", "--llm", "llama-3.2-1b"], capsys, "nope-vit"
    )
    _expect_error(
        ["profile", str(idx), "--encoder", "siglip-so400m", "--llm", "gpt-9"], capsys, "gpt-9"
    )
    # the index has images but no vision encoder was given
    _expect_error(["profile", str(idx), "--llm", "llama-3.2-1b"], capsys, "vision encoder")
    _expect_error(
        [
            "profile",
            str(idx),
            "--encoder",
            "siglip-so400m",
            "--llm",
            "llama-3.2-1b",
            "--global-batch",
            "301",
        ],
        capsys,
        "exceeds",
    )
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    _expect_error(
        ["profile", str(bad), "--encoder", "siglip-so400m", "--llm", "llama-3.2-1b"],
        capsys,
        "bad.parquet",
    )
    # negative sizes in an otherwise well-formed index
    t = pq.read_table(idx)
    i = t.schema.get_field_index("text_tokens")
    neg = t.set_column(i, "text_tokens", pa.array([-5] + [1] * (len(t) - 1), type=pa.int32()))
    pq.write_table(neg, tmp_path / "neg.parquet")
    _expect_error(
        [
            "profile",
            str(tmp_path / "neg.parquet"),
            "--encoder",
            "siglip-so400m",
            "--llm",
            "llama-3.2-1b",
        ],
        capsys,
        "text_tokens",
    )
    _expect_error(["synth", "nope", "-o", str(tmp_path / "x.parquet")], capsys, "nope")
    _expect_error(
        ["synth", "llava-fixed", "--samples", "-3", "-o", str(tmp_path / "x.parquet")],
        capsys,
        "samples",
    )


@pytest.mark.skipif(not HAVE_FULL_CLI, reason="entrain_data.cli_plan not written yet")
def test_console_script_runs(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "entrain_data.cli", "models"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "llama-3.1-70b" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "entrain_data.cli",
            "profile",
            str(tmp_path / "missing.parquet"),
            "--llm",
            "llama-3.2-1b",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing.parquet" in r.stderr


@pytest.mark.shared_data
def test_synth_real_table_subsampled(shared_data, tmp_path, capsys):
    out = tmp_path / "ls.parquet"
    assert (
        _main(
            [
                "synth",
                "librispeech",
                "--data-dir",
                str(shared_data),
                "--samples",
                "500",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    t = read_index(out)
    assert len(t) == 500 and len(t.audio_seconds) == 500
    capsys.readouterr()
    _expect_error(["synth", "librispeech", "-o", str(out)], capsys, "--data-dir")


def test_calibrate_fits_measurements_and_profile_applies_them(tmp_path, capsys):
    import numpy as np

    from entrain_data.cost_model import module_features
    from entrain_data.presets import ModelSpec

    idx = tmp_path / "t.parquet"
    assert (
        _main(["synth", "qwen2vl-dynamic", "--samples", "400", "--seed", "2", "-o", str(idx)]) == 0
    )
    t = read_index(idx)
    spec = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")
    rng = np.random.default_rng(0)
    lines = []
    for module, (a, b, c) in {
        "llm": (0.8, 1.5, 0.01),
        "qwen2.5-vl-vision": (1.2, 0.9, 0.005),
    }.items():
        lin, att = module_features(t, spec, module)
        for _ in range(60):
            g = rng.choice(len(t), size=6, replace=False)
            secs = a * lin[g].sum() + b * att[g].sum() + c
            lines.append(
                json.dumps({"module": module, "seconds": secs, "keys": [str(k) for k in t.keys[g]]})
            )
    meas = tmp_path / "m.jsonl"
    meas.write_text("\n".join(lines) + "\n")
    cal = tmp_path / "cal.json"
    argv = [
        "calibrate",
        str(idx),
        str(meas),
        "--encoder",
        "qwen2.5-vl-vision",
        "--llm",
        "llama-3.2-1b",
    ]
    assert _main(argv + ["-o", str(cal)]) == 0
    out = capsys.readouterr().out
    assert "rel RMS" in out and "qwen2.5-vl-vision" in out
    d = json.loads(cal.read_text())
    assert d["modules"]["llm"]["linear"] == pytest.approx(0.8, rel=1e-3)
    assert d["modules"]["qwen2.5-vl-vision"]["constant"] == pytest.approx(0.005, rel=1e-2)
    prof = [
        "profile",
        str(idx),
        "--encoder",
        "qwen2.5-vl-vision",
        "--llm",
        "llama-3.2-1b",
        "--global-batch",
        "64",
    ]
    assert _main(prof + ["--calibration", str(cal)]) == 0
    meas.write_text(json.dumps({"module": "llm", "seconds": 1.0, "keys": ["no-such-key"]}) + "\n")
    capsys.readouterr()
    _expect_error(argv + ["-o", str(cal)], capsys, "no-such-key")
