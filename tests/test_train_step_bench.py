"""bench/train_step.py keeps working on CPU (tiny model), and its model attends per segment."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from entrain_data.cost_model import per_sample_costs
from entrain_data.tokens import _window_sumsq
from entrain_data.workloads import synthesize

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


train_step = _load("train_step")
model = sys.modules["_train_step_model"]


def _finite_stats(s: dict) -> None:
    assert math.isfinite(s["mean_ms"]) and s["mean_ms"] > 0
    assert math.isfinite(s["std_ms"]) and s["std_ms"] >= 0


@pytest.mark.timeout(180)
def test_tiny_cpu_run_writes_sensible_json(tmp_path):
    out = tmp_path / "ts.json"
    res = train_step.main(["--device", "cpu", "--tiny", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["device"] == "cpu" and data["config"]["tiny"]
    c = data["config"]
    n_mb = c["dp"] * c["microbatches"] * c["iterations"]
    gb = c["global_batch"]
    for m in ("sequential", "entrain"):
        s = data["methods"][m]
        for k in ("encoder_fwd", "encoder_bwd", "llm_fwd", "llm_bwd"):
            _finite_stats(s[k])
        mbs = s["microbatches"]
        assert len(mbs) == n_mb
        for it in range(c["iterations"]):
            rows = range(it * gb, (it + 1) * gb)
            for key in ("encoder_rows", "llm_rows"):  # every sample once per iteration
                got = sorted(r for x in mbs if x["iteration"] == it for r in x[key])
                assert got == list(rows)
    for m, r in data["std_ratio_vs_sequential"].items():
        assert all(v > 0 for v in r.values()), m
    for mod, fits in data["calibration"].items():
        for phase in ("forward", "step"):
            f = fits[phase]
            assert math.isfinite(f["rel_rms"]) and f["rel_rms"] >= 0, (mod, phase)
            assert f["r2"] <= 1.0 and f["n"] >= 2
            assert min(f["linear"], f["quadratic"], f["constant"]) >= 0
    for k, sims in data["simulation"].items():
        for m, v in sims.items():
            assert v["iteration_time_s"] > 0 and v["ideal_s"] > 0, (k, m)
            # no pipeline beats its busiest stage's work
            assert v["iteration_time_s"] >= v["lower_bound_s"] * (1 - 1e-9), (k, m)
        assert sims["sequential"]["speedup_vs_sequential"] == pytest.approx(1.0)
    assert res["simulation"] == data["simulation"]
    # the saved calibration re-applies to the cost model
    cal = json.loads((tmp_path / "ts_calibration.json").read_text())
    spec = train_step.bench_spec(tiny=True)
    table = synthesize("qwen2vl-dynamic", 4, seed=0)
    calibrated = per_sample_costs(table, spec, calibration=cal)
    assert np.all(np.isfinite(calibrated.encoder_cost())) and set(cal["modules"]) == {
        "tiny-vit",
        "llm",
    }


def test_varlen_attention_matches_per_segment_reference():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 3, 0, 7, 5, 1]
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g)
    k = torch.randn(t, 2, 8, generator=g)
    v = torch.randn(t, 2, 8, generator=g)
    plan = model.SegmentPlan.build(lengths, torch.device("cpu"))
    for causal in (False, True):
        got = model.varlen_attention(q, k, v, plan, causal)
        ref, s = [], 0
        for n in lengths:
            if n:
                qq = q[s : s + n].transpose(0, 1)
                kk = k[s : s + n].repeat_interleave(2, dim=1).transpose(0, 1)
                vv = v[s : s + n].repeat_interleave(2, dim=1).transpose(0, 1)
                ref.append(
                    F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).transpose(0, 1)
                )
            s += n
        torch.testing.assert_close(got, torch.cat(ref))


def test_model_token_counts_match_cost_model():
    spec = train_step.bench_spec(tiny=True, vision_layers=None, llm_layers=None)
    cfg = spec.encoders[0]
    table = synthesize("qwen2vl-dynamic", 64, seed=3)
    costs = per_sample_costs(table, spec)
    grids = model.item_grids(table, cfg)
    train_step._check_tokens(table, grids, cfg, costs)  # raises on a mismatch
    for _, gh, gw in grids:  # windows tile the grid, with the cost model's sum of squares
        w = model.window_lengths(int(gh), int(gw), cfg)
        assert sum(w) == gh * gw
        m = cfg.merge
        want = _window_sumsq(np.array([gh // m]), np.array([gw // m]), cfg.window_patches // m)
        assert sum(x * x for x in w) == pytest.approx(float(want[0]) * m**4)


def test_vision_and_llm_inputs_have_the_packed_shapes():
    spec = train_step.bench_spec(tiny=True, vision_layers=None, llm_layers=None)
    cfg = spec.encoders[0]
    table = synthesize("qwen2vl-dynamic", 8, seed=1)
    costs = per_sample_costs(table, spec)
    grids = model.item_grids(table, cfg)
    rows = np.array([0, 3, 5])
    dev, g = torch.device("cpu"), torch.Generator().manual_seed(0)
    vi = model.build_vision_inputs(table, cfg, grids, rows, dev, torch.float32, g, spec.llm.hidden)
    assert vi.patches.shape[0] == int(costs.encoder_tokens[rows, 0].sum())
    vit = model.VisionTower(cfg, spec.llm.hidden)
    assert vit(vi.patches, vi.full, vi.windows).shape == vi.grad_out.shape
    li = model.build_llm_inputs(
        spec.llm, costs.llm_tokens, costs.vision_tokens, rows, dev, torch.float32, g
    )
    assert li.input_ids.numel() == int(costs.llm_tokens[rows].sum())
    assert int(li.media_mask.sum()) == int(costs.vision_tokens[rows].sum())
    llm = model.DecoderLLM(spec.llm)
    loss = llm(li.input_ids, li.labels, li.media, li.media_mask, li.plan)
    loss.backward()
    assert torch.isfinite(loss) and li.media.grad is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_cpu_command_line(tmp_path):
    out = tmp_path / "cli.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "train_step.py"),
            "--device",
            "cpu",
            "--tiny",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "std sequential/entrain" in proc.stdout
    assert json.loads(out.read_text())["methods"]["entrain"]["llm_fwd"]["mean_ms"] > 0


def test_audio_inputs_match_cost_model_tokens():
    spec = train_step.bench_spec(tiny=True, audio=True)
    aud = spec.encoders[1]
    table = synthesize("vision-audio", 24, seed=2)
    costs = per_sample_costs(table, spec)
    rows = np.flatnonzero(np.diff(table.audio_offsets) > 0)[:4]
    assert len(rows)
    g = torch.Generator().manual_seed(0)
    ai = model.build_audio_inputs(
        table, aud, rows, torch.device("cpu"), torch.float32, g, spec.llm.hidden
    )
    assert ai.plan.total == int(costs.encoder_tokens[rows, 1].sum())
    tower = model.AudioTower(aud, spec.llm.hidden)
    y = tower.forward_inputs(ai)
    assert y.shape == (int(costs.audio_tokens[rows].sum()), spec.llm.hidden) == ai.grad_out.shape


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tiny_cpu_vision_audio_run(tmp_path):
    out = tmp_path / "va.json"
    train_step.main(["--device", "cpu", "--tiny", "--workload", "vision-audio", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data["calibration"]) == {"tiny-vit", "tiny-audio", "llm"}
    for m in ("sequential", "entrain"):
        per = data["methods"][m]["per_encoder"]
        assert per["tiny-audio"]["fwd"]["mean_ms"] > 0
        total = sum(x["encoder_fwd"] for x in data["methods"][m]["microbatches"])
        parts = sum(
            x["per_encoder"][e]["fwd"] for x in data["methods"][m]["microbatches"] for e in per
        )
        assert total == pytest.approx(parts)


def test_recompute_and_chunked_loss_do_not_change_gradients():
    spec = train_step.bench_spec(tiny=True)
    table = synthesize("qwen2vl-dynamic", 6, seed=4)
    costs = per_sample_costs(table, spec)
    g = torch.Generator().manual_seed(0)
    li = model.build_llm_inputs(
        spec.llm, costs.llm_tokens, costs.vision_tokens, np.arange(6), torch.device("cpu"),
        torch.float32, g,
    )  # fmt: skip
    grads = []
    for recompute, chunk in ((False, 1 << 20), (True, 97)):
        torch.manual_seed(0)
        llm = model.DecoderLLM(spec.llm, recompute=recompute, loss_chunk=chunk)
        media = li.media.detach().clone().requires_grad_(True)
        loss = llm(li.input_ids, li.labels, media, li.media_mask, li.plan)
        loss.backward()
        grads.append((loss.detach(), media.grad, llm.layers[0].qkv.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_repeated_timings_keep_the_median_per_measure():
    """One spike among a microbatch's repeats (a GC pause, a first-seen shape) is dropped."""
    runs = [
        {"encoder_fwd": f, "llm_fwd": lf, "per_encoder": {"vit": {"fwd": f}}}
        for f, lf in ((0.030, 0.020), (0.250, 0.021), (0.031, 0.165))
    ]
    got = train_step._median_of(runs)
    assert got["encoder_fwd"] == pytest.approx(0.031)
    assert got["llm_fwd"] == pytest.approx(0.021)
    assert got["per_encoder"]["vit"]["fwd"] == pytest.approx(0.031)


def test_methods_are_timed_microbatch_by_microbatch_in_turn():
    """Every (iteration, position, method) is timed once; each position's methods back to
    back, the first one rotating, so neither method pays the GPU's warm-up or drift alone."""
    methods = ["sequential", "entrain", "verl_kk"]
    order = train_step.timing_order(methods, iterations=2, count=5)
    assert sorted(order) == sorted((it, i, m) for it in range(2) for i in range(5) for m in methods)
    for k in range(0, len(order), 3):
        group = order[k : k + 3]
        assert len({(it, i) for it, i, _ in group}) == 1 and {m for *_, m in group} == set(methods)
    firsts = [order[k][2] for k in range(0, len(order), 3)]
    assert all(firsts.count(m) >= 3 for m in methods)  # 10 positions, each method leads 3-4


@pytest.mark.timeout(180)
def test_residuals_read_a_run_microbatch_by_microbatch(tmp_path, capsys):
    """bench/train_step_residuals.py rebuilds the run's predicted costs and splits the measured
    times into a pooled fit and each method's residuals (they cancel: one fit, least squares)."""
    residuals = _load("train_step_residuals")
    out = tmp_path / "ts.json"
    res = train_step.main(["--device", "cpu", "--tiny", "--iterations", "2", "--out", str(out)])
    got = residuals.main([str(out)])
    assert "residual by fifth" in capsys.readouterr().out
    for mod, keys in (("encoder", ("encoder_fwd", "encoder_bwd")), ("llm", ("llm_fwd", "llm_bwd"))):
        per = got[mod]["methods"]
        assert set(per) == {"sequential", "entrain"}
        for m, d in per.items():
            measured = sum(x[k] for x in res["methods"][m]["microbatches"] for k in keys)
            assert d["measured_s"] == pytest.approx(measured)
            assert len(d["residual_ms_by_iteration"]) == 2
        n = {m: len(res["methods"][m]["microbatches"]) for m in per}
        assert sum(per[m]["residual_ms"] * n[m] for m in per) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.timeout(180)
def test_tiny_cpu_run_with_repeats(tmp_path):
    out = tmp_path / "ts.json"
    train_step.main(["--device", "cpu", "--tiny", "--repeats", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["repeats"] == 2
    assert len(data["methods"]["entrain"]["microbatches"]) == 4
    with pytest.raises(SystemExit):
        train_step.main(["--device", "cpu", "--tiny", "--repeats", "0", "--out", str(out)])


def test_capped_vision_preset_prices_what_the_model_runs():
    """The 1280-token preset: the model's patch grids are the cost model's, images capped."""
    spec = train_step.bench_spec(tiny=False, vision_preset="qwen2.5-vl-vision-1280")
    cfg = spec.encoders[0]
    assert cfg.name == "qwen2.5-vl-vision-1280-16l" and cfg.layers == 16
    table = synthesize("qwen2vl-dynamic", 128, seed=1)
    costs = per_sample_costs(table, spec)
    grids = model.item_grids(table, cfg)
    train_step._check_tokens(table, grids, cfg, costs)
    assert grids.prod(axis=1).max() <= 1280 * cfg.merge**2
    with pytest.raises(ValueError, match="vision_preset"):
        train_step.bench_spec(tiny=False, vision_preset="siglip-so400m")


@pytest.mark.timeout(180)
def test_told_depth_is_simulated_with_the_proxy_layout(tmp_path):
    """--pp N tells entrain the depth and simulates N stages laid as its proxy lays them,
    each microbatch's measured work split over the stages without loss."""
    out = tmp_path / "ts.json"
    res = train_step.main(["--device", "cpu", "--tiny", "--pp", "3", "--out", str(out)])
    assert res["config"]["pp"] == 3
    sims = res["simulation"]["pp3"]
    for m, v in sims.items():
        assert v["iteration_time_s"] >= v["lower_bound_s"] * (1 - 1e-9), m
    rep = sys.modules["_train_step_report"]
    names = [c.name for c in train_step.bench_spec(tiny=True).encoders]
    x = res["methods"]["entrain"]["microbatches"][0]
    fwd, bwd = rep._module_times(x, names)
    shares = rep.proxy_stage_shares(np.array([3.0, 1.0]), 3)
    c = res["config"]
    f, b = rep._stage_times([x], x["iteration"], c["dp"], c["microbatches"], shares, names)
    s_fwd, s_bwd = f[x["replica"], x["microbatch"]], b[x["replica"], x["microbatch"]]
    assert len(s_fwd) == 3 and s_fwd.sum() == pytest.approx(fwd.sum())
    assert s_bwd.sum() == pytest.approx(bwd.sum())
    # the K-stage layouts are the same mechanism: every encoder on stage 0, the LLM even
    k2 = rep._llm_shares(2, len(names))
    assert k2 @ fwd == pytest.approx([x["encoder_fwd"], x["llm_fwd"] / 2, x["llm_fwd"] / 2])
    assert k2 @ bwd == pytest.approx([x["encoder_bwd_arrival"], x["llm_bwd"] / 2, x["llm_bwd"] / 2])
    with pytest.raises(SystemExit):
        train_step.main(["--device", "cpu", "--tiny", "--pp", "-1", "--out", str(out)])


@pytest.mark.timeout(180)
def test_plan_layout_is_told_and_simulated(tmp_path):
    """--layout plan lays the stages at the planner's layer ranges, tells entrain their shares
    and simulates them beside the proxy's layout; it needs a depth."""
    out = tmp_path / "ts.json"
    args = ["--device", "cpu", "--tiny", "--pp", "3", "--layout", "plan", "--out", str(out)]
    res = train_step.main(args)
    shares = np.asarray(res["config"]["plan_shares"])
    assert res["config"]["layout"] == "plan" and shares.shape == (3, 2)
    np.testing.assert_allclose(shares.sum(axis=0), 1.0)
    assert {"pp3", "plan3"} <= set(res["simulation"])
    for m, v in res["simulation"]["plan3"].items():
        assert v["iteration_time_s"] >= v["lower_bound_s"] * (1 - 1e-9), m
    with pytest.raises(SystemExit):
        train_step.main(["--device", "cpu", "--tiny", "--layout", "plan", "--out", str(out)])
