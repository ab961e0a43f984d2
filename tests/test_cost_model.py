"""Cost model: hand-computed FLOPs, GQA, frozen encoders, stage costs, presets, calibration."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrain_data.calibration import Calibration, fit_coefficients
from entrain_data.cost_model import (
    H100_BF16,
    Hardware,
    attention_flops_coeff,
    calibrate,
    layer_linear_flops,
    module_features,
    per_sample_costs,
)
from entrain_data.errors import InvalidInput
from entrain_data.metadata import SampleMeta, SampleTable, VisionItem
from entrain_data.presets import ModelSpec, ModuleConfig, list_presets, load_module
from entrain_data.tokens import internvl_tiles, smart_resize

REQUIRED = [
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
]

# a unit hardware: 1 FLOP/s at 100% efficiency, so seconds == FLOPs
UNIT = Hardware(name="unit", peak_flops=1.0, linear_efficiency=1.0, attention_efficiency=1.0)


def tiny_vit(**kw) -> ModuleConfig:
    d = dict(
        name="tiny-vit",
        kind="vision",
        hidden=8,
        layers=2,
        ffn=16,
        heads=2,
        kv_heads=2,
        patch_size=2,
        merge=1,
        resize="fixed",
        image_size=4,
    )
    d.update(kw)
    return ModuleConfig(**d)


def tiny_llm(**kw) -> ModuleConfig:
    d = dict(
        name="tiny-llm",
        kind="llm",
        hidden=8,
        layers=3,
        ffn=12,
        heads=4,
        kv_heads=2,
        gated_mlp=True,
        vocab=10,
    )
    d.update(kw)
    return ModuleConfig(**d)


def table(records) -> SampleTable:
    return SampleTable.from_records(records)


def test_required_presets_load_with_published_numbers():
    names = list_presets()
    for n in REQUIRED:
        assert n in names
        m = load_module(n)
        assert m.name == n and m.source
    l8 = load_module("llama-3.1-8b")
    assert (l8.hidden, l8.layers, l8.ffn, l8.heads, l8.kv_heads) == (4096, 32, 14336, 32, 8)
    # parameter counts land on the published model sizes
    assert 7.9e9 < l8.parameters() < 8.1e9
    assert 70e9 < load_module("llama-3.1-70b").parameters() < 71e9
    assert 7.5e9 < load_module("qwen2.5-7b").parameters() < 7.7e9
    assert 1.2e9 < load_module("llama-3.2-1b").parameters() < 1.3e9
    qv = load_module("qwen2.5-vl-vision")
    assert qv.full_attention_layers == (7, 15, 23, 31) and qv.window_patches == 8


def test_load_module_from_json_path_and_errors(tmp_path):
    cfg = tiny_llm()
    p = tmp_path / "m.json"
    p.write_text(json.dumps(cfg.to_dict()))
    assert load_module(str(p)) == cfg
    with pytest.raises(InvalidInput, match="unknown model preset 'nope'"):
        load_module("nope")
    with pytest.raises(InvalidInput, match="not found"):
        load_module(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(InvalidInput, match="not valid JSON"):
        load_module(str(bad))
    d = cfg.to_dict()
    d["hidden"] = -1
    bad.write_text(json.dumps(d))
    with pytest.raises(InvalidInput, match="'hidden'"):
        load_module(str(bad))
    d = cfg.to_dict()
    d["colour"] = 3
    bad.write_text(json.dumps(d))
    with pytest.raises(InvalidInput, match="unknown field.*'colour'"):
        load_module(str(bad))


def test_hand_computed_flops_tiny_vit_and_gqa_llm():
    vit, llm = tiny_vit(), tiny_llm()
    # ViT: q = 8, kv = 16, out = 64, MLP not gated 2 * 8 * 16
    assert layer_linear_flops(vit) == 2 * (8 * (8 + 16) + 8 * 8 + 2 * 8 * 16)
    assert attention_flops_coeff(vit) == 4 * 8
    # GQA LLM: head_dim 2, q = 8, kv = 2 * 2 * 2 = 8, SwiGLU 3 * 8 * 12
    assert layer_linear_flops(llm) == 2 * (8 * (8 + 8) + 8 * 8 + 3 * 8 * 12)
    assert attention_flops_coeff(llm) == 0.5 * 4 * 8  # causal halves it
    # GQA with fewer KV heads costs less
    assert layer_linear_flops(tiny_llm(kv_heads=1)) < layer_linear_flops(llm)

    spec = ModelSpec(encoders=(vit,), llm=llm)
    t = table([SampleMeta("a", "s", 5, images=(VisionItem(1, 100, 50), VisionItem(1, 7, 7)))])
    c = per_sample_costs(t, spec, hardware=UNIT)
    # fixed 4 px resize, patch 2: 4 tokens per image, 2 images
    assert c.encoder_tokens[0, 0] == 8 and c.vision_tokens[0] == 8 and c.llm_tokens[0] == 13
    enc_layer = 8 * layer_linear_flops(vit) + 2 * 16 * attention_flops_coeff(vit)
    assert c.encoder_layer_fwd[0, 0] == pytest.approx(enc_layer)
    llm_layer = 13 * layer_linear_flops(llm) + 13**2 * attention_flops_coeff(llm)
    assert c.llm_layer_fwd[0] == pytest.approx(llm_layer)
    assert c.llm_fixed_fwd[0] == pytest.approx(13 * 2 * 10 * 8)  # LM head
    assert c.encoder_embed_fwd[0, 0] == pytest.approx(8 * 2 * 3 * 4 * 8)  # patch embed
    assert c.llm_cost()[0] == pytest.approx(3 * (3 * llm_layer + 13 * 2 * 10 * 8))


def test_reference_hardware_converts_flops_to_seconds():
    spec = ModelSpec(encoders=(), llm=tiny_llm())
    t = table([SampleMeta("a", "s", 1000)])
    unit = per_sample_costs(t, spec, hardware=UNIT).llm_layer_fwd[0]
    ref = per_sample_costs(t, spec).llm_layer_fwd[0]
    lin = (
        1000 * layer_linear_flops(tiny_llm()) / (H100_BF16.peak_flops * H100_BF16.linear_efficiency)
    )
    att = (
        1000**2
        * attention_flops_coeff(tiny_llm())
        / (H100_BF16.peak_flops * H100_BF16.attention_efficiency)
    )
    assert ref == pytest.approx(lin + att) and unit > ref


def test_frozen_encoder_has_no_backward():
    vit = tiny_vit()
    t = table([SampleMeta("a", "s", 3, images=(VisionItem(1, 4, 4),))])
    train = per_sample_costs(t, ModelSpec((vit,), tiny_llm()), hardware=UNIT)
    frozen = per_sample_costs(t, ModelSpec((vit.with_frozen(),), tiny_llm()), hardware=UNIT)
    assert train.encoder_bwd_factor[0] == 2.0 and frozen.encoder_bwd_factor[0] == 0.0
    assert frozen.encoder_cost()[0, 0] == pytest.approx(train.encoder_cost()[0, 0] / 3)
    _, bwd = frozen.stage_cost(0, 0, 2, True, True)
    assert bwd[0] == 0.0
    assert frozen.llm_cost()[0] == train.llm_cost()[0]


def test_stage_costs_sum_to_module_total_with_window_layers():
    spec = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-1b")
    t = table(
        [
            SampleMeta("a", "s", 40, images=(VisionItem(1, 1080, 1920), VisionItem(8, 360, 640))),
            SampleMeta("b", "s", 900, audio_seconds=(12.5, 41.0)),
            SampleMeta("c", "s", 7),
        ]
    )
    c = per_sample_costs(t, spec)
    for e, cuts in ((0, [0, 5, 8, 20, 32]), (1, [0, 16, 32])):
        parts = [
            c.stage_cost(e, a, b, first=a == 0, last=b == cuts[-1])
            for a, b in zip(cuts[:-1], cuts[1:])
        ]
        assert np.allclose(sum(p[0] for p in parts), c.encoder_fwd()[:, e])
        assert np.allclose(sum(p[0] + p[1] for p in parts), c.encoder_cost()[:, e])
    cuts = [0, 3, 9, 16]
    parts = [c.stage_cost(None, a, b, a == 0, b == 16) for a, b in zip(cuts[:-1], cuts[1:])]
    assert np.allclose(sum(p[0] + p[1] for p in parts), c.llm_cost())
    # a full-attention layer of a 1080p image costs more than a window layer
    assert c.encoder_full_layer_fwd[0, 0] > c.encoder_window_layer_fwd[0, 0]
    with pytest.raises(InvalidInput, match="layer range"):
        c.stage_cost(None, 3, 17, False, True)


def test_qwen_smart_resize_and_merge_match_reference_numbers():
    # 640x480 -> 644x476 -> 46x34 patches -> 391 merged tokens (Qwen2-VL's known figure)
    hb, wb = smart_resize(np.array([480]), np.array([640]), 28, 3136, 12845056)
    assert (hb[0], wb[0]) == (476, 644)
    spec = ModelSpec.from_names(["qwen2.5-vl-vision"], "qwen2.5-7b")
    t = table([SampleMeta("a", "s", 0, images=(VisionItem(1, 480, 640),))])
    c = per_sample_costs(t, spec)
    assert c.encoder_tokens[0, 0] == 1564 and c.vision_tokens[0] == 391
    # an A4 page at 600 dpi is capped at max_pixels (12845056 = 16384 merged tokens)
    t = table([SampleMeta("a", "s", 0, images=(VisionItem(1, 7016, 4961),))])
    assert per_sample_costs(t, spec).vision_tokens[0] <= 16384
    # a video clip: frames grouped by the temporal patch of 2
    t = table([SampleMeta("a", "s", 0, images=(VisionItem(16, 476, 644),))])
    assert per_sample_costs(t, spec).vision_tokens[0] == 8 * 391


def test_fixed_tiles_and_audio_token_counts():
    t = table([SampleMeta("a", "s", 0, images=(VisionItem(1, 1000, 3000),))])
    sig = per_sample_costs(t, ModelSpec.from_names(["siglip-so400m"], "llama-3.2-1b"))
    assert sig.vision_tokens[0] == 729
    assert internvl_tiles(np.array([448]), np.array([448]), 448, 12)[0] == 1
    assert internvl_tiles(np.array([1000]), np.array([4000]), 448, 12)[0] == 4
    iv = per_sample_costs(t, ModelSpec.from_names(["internvit-300m"], "llama-3.2-1b"))
    assert iv.vision_tokens[0] % 256 == 0 and iv.encoder_tokens[0, 0] % 1025 == 0
    a = table([SampleMeta("a", "s", 0, audio_seconds=(10.0, 45.0))])
    wc = per_sample_costs(a, ModelSpec.from_names(["whisper-large-v3-encoder"], "llama-3.2-1b"))
    assert wc.encoder_tokens[0, 0] == 1500 * 3  # padded 30 s windows: 1 + 2
    assert wc.audio_tokens[0] == 250 + 1125  # 25 LLM tokens per second after pooling


def test_missing_encoder_for_modality_is_named():
    t = table([SampleMeta("a", "s", 0, audio_seconds=(3.0,))])
    with pytest.raises(InvalidInput, match="audio"):
        per_sample_costs(t, ModelSpec.from_names(["siglip-so400m"], "llama-3.2-1b"))


def test_vectorised_65k_samples_fast():
    rng = np.random.default_rng(0)
    n = 65536
    counts = rng.integers(0, 3, n)
    k = int(counts.sum())
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    t = SampleTable(
        keys=np.array([f"k{i}" for i in range(n)], dtype=object),
        sources=np.full(n, "s", dtype=object),
        members=np.full(n, "", dtype=object),
        rows=np.arange(n, dtype=np.int64),
        text_tokens=rng.integers(10, 3000, n),
        image_offsets=off,
        image_frames=np.ones(k, dtype=np.int32),
        image_height=rng.integers(100, 3000, k).astype(np.int32),
        image_width=rng.integers(100, 3000, k).astype(np.int32),
        audio_offsets=np.zeros(n + 1, dtype=np.int64),
        audio_seconds=np.zeros(0, dtype=np.float32),
    )
    spec = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.1-8b")
    t0 = time.perf_counter()
    c = per_sample_costs(t, spec)
    assert time.perf_counter() - t0 < 1.0
    assert c.encoder_cost().shape == (n, 1) and np.all(c.llm_cost() > 0)


def test_calibration_recovers_known_coefficients_from_noisy_data():
    rng = np.random.default_rng(1)
    recs = [
        SampleMeta(
            f"k{i}",
            "s",
            int(rng.integers(50, 16000)),
            images=(VisionItem(1, int(rng.integers(200, 4000)), 1600),),
        )
        for i in range(400)
    ]
    t = table(recs)
    spec = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")
    groups = [rng.choice(len(t), size=int(rng.integers(1, 8)), replace=False) for _ in range(120)]
    true = {"llm": (0.7, 1.8, 0.02), "qwen2.5-vl-vision": (1.3, 0.6, 0.01)}
    cal = None
    for mod, (a, b, c0) in true.items():
        lin, att = module_features(t, spec, mod)
        y = np.array([a * lin[g].sum() + b * att[g].sum() + c0 for g in groups])
        y *= 1 + 0.01 * rng.standard_normal(len(y))
        cal = calibrate(t, spec, mod, groups, y, previous=cal)
    for mod, (a, b, c0) in true.items():
        fit = cal.get(mod)
        assert fit.linear == pytest.approx(a, rel=0.05)
        # attention is a small share of a windowed ViT's time, so its scale is less well determined
        assert fit.quadratic == pytest.approx(b, rel=0.15 if mod == "llm" else 0.35)
        assert fit.constant == pytest.approx(c0, rel=0.3)
        assert fit.rel_rms < 0.03 and fit.r2 > 0.99
    # round trip through JSON, re-applied to the costs
    cal2 = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert cal2 == cal
    base = per_sample_costs(t, spec)
    scaled = per_sample_costs(t, spec, calibration=cal2.to_dict())
    lin, att = module_features(t, spec, "llm")
    per_layer = (0.7 * lin + 1.8 * att - 0.7 * base.llm_fixed_fwd) / base.llm_layers
    assert np.allclose(scaled.llm_layer_fwd, per_layer, rtol=0.15)
    assert scaled.llm_call_overhead == pytest.approx(0.02, rel=0.3)


def test_fit_coefficients_rejects_bad_measurements_and_stays_non_negative():
    x = np.arange(1.0, 11.0)
    with pytest.raises(InvalidInput, match="> 0"):
        fit_coefficients(x, x, -x)
    with pytest.raises(InvalidInput, match="same length"):
        fit_coefficients(x, x[:3], x)
    # y falls with the attention feature: the unconstrained fit is negative, the non-negative one drops it
    fit = fit_coefficients(x, x**2, 2 * x + 1 - 0.01 * x**2)
    assert fit.quadratic == 0.0 and fit.r2 > 0.9
    fit = fit_coefficients(x, x**2, 2 * x + 1)
    assert (
        fit.quadratic == 0.0
        and fit.linear == pytest.approx(2.0)
        and fit.constant == pytest.approx(1.0)
    )


def test_model_spec_round_trip():
    spec = ModelSpec.from_names(
        ["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "qwen2.5-7b", frozen_encoders=True
    )
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and all(e.frozen for e in again.encoders)
    assert again.module_names == ("qwen2.5-vl-vision", "whisper-large-v3-encoder", "llm")


def test_llm_training_flops_follow_the_6nd_rule():
    cfg = load_module("llama-3.1-8b")
    assert layer_linear_flops(cfg) == 2 * cfg.layer_parameters()
    n = 2048
    t = table([SampleMeta("a", "s", n)])
    c = per_sample_costs(t, ModelSpec((), cfg), hardware=UNIT)
    non_embedding = cfg.layers * cfg.layer_parameters() + cfg.head_parameters()
    attention = 3 * cfg.layers * attention_flops_coeff(cfg) * n * n
    assert c.llm_cost()[0] == pytest.approx(6 * non_embedding * n + attention, rel=1e-9)
    # attention is a modest share at 2k tokens for an 8B model (~6%), growing with length
    assert 0.03 < attention / c.llm_cost()[0] < 0.12


@settings(max_examples=40, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 31), max_size=6, unique=True),
    e=st.integers(0, 1),
    frozen=st.booleans(),
)
def test_any_stage_split_sums_to_the_module(cuts, e, frozen):
    spec = ModelSpec.from_names(
        ["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "qwen2.5-7b", frozen_encoders=frozen
    )
    c = per_sample_costs(_MIXED, spec)
    layers = c.encoder_layers[e]
    bounds = [0] + sorted(x for x in cuts if x < layers) + [layers]
    fwd = sum(
        c.stage_cost(e, a, b, a == 0, b == layers)[0] for a, b in zip(bounds[:-1], bounds[1:])
    )
    bwd = sum(
        c.stage_cost(e, a, b, a == 0, b == layers)[1] for a, b in zip(bounds[:-1], bounds[1:])
    )
    assert np.allclose(fwd + bwd, c.encoder_cost()[:, e])
    assert np.allclose(bwd, 0.0) == frozen


_MIXED = SampleTable.from_records(
    [
        SampleMeta("a", "s", 40, images=(VisionItem(1, 2000, 3000), VisionItem(12, 360, 640))),
        SampleMeta("b", "s", 900, audio_seconds=(75.0,)),
        SampleMeta("c", "s", 7, images=(VisionItem(1, 28, 28),), audio_seconds=(0.5,)),
    ]
)
