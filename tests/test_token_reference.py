"""Token counts against transformers' own functions, over many sizes and durations (no shared data).

The cost model prices, and the packer lays out, what the published processors produce: Qwen2-VL's
``smart_resize`` (and ``Qwen2VLImageProcessorPil``'s grid and pixels) for dynamic resolution,
``WhisperFeatureExtractor``'s frame mask and the encoders' ``_get_feat_extract_output_lengths``
(Whisper: conv stem; Qwen2-Audio: conv stem, then stride-2 pooling) for audio. Sizes are swept
exhaustively where the reference is cheap to call, so a rounding branch cannot hide.
"""

from __future__ import annotations

import io
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from entrain_data.workers import decode
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.packing import make_packer
from entrain_data.workers.transforms import AudioTransform, VisionTransform
from test_index_builder import write_shard

from entrain_data.batch import normalize_pixels
from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import write_index
from entrain_data.presets import ModelSpec, list_presets, load_module
from entrain_data.tokens import (
    aspect_over_limit,
    audio_frames,
    audio_tokens,
    smart_resize,
    vision_tokens,
)

transformers = pytest.importorskip(
    "transformers", reason="transformers' processors are the reference"
)
from PIL import Image  # noqa: E402

try:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as hf_smart_resize,
    )
except ImportError as exc:  # an older transformers: same function, torchvision-free module absent
    pytest.skip(
        f"transformers has no Qwen2-VL PIL image processor ({exc})", allow_module_level=True
    )

QWEN = load_module("qwen2.5-vl-vision")
AUDIO_PRESETS = [n for n in list_presets() if load_module(n).kind == "audio"]
# (min_pixels, max_pixels) of every dynamic bound the presets use: images, the 1280-token cap,
# video frames, and a small cap that makes the scale-down branch common
BOUNDS = [(3136, 12845056), (3136, 1003520), (100352, 602112), (3136, 256 * 28 * 28)]


def _ref_grids(sizes: list[tuple[int, int]], lo: int, hi: int) -> np.ndarray:
    return np.array([hf_smart_resize(h, w, 28, lo, hi) for h, w in sizes], dtype=np.int64)


def test_smart_resize_equals_transformers_for_every_size():
    """Every (h, w) up to 80 px, thin strips to 3000 px and random sizes to 10000 px, every bound."""
    rng = np.random.default_rng(0)
    small = list(itertools.product(range(1, 81), range(1, 81)))
    strips = [(s, L) for s in range(1, 30) for L in (150, 400, 999, 1500, 2000, 2800, 2999)]
    strips += [(L, s) for s, L in strips]
    rand = [tuple(map(int, x)) for x in rng.integers(1, 10000, (3000, 2))]
    sizes = [(h, w) for h, w in small + strips + rand if max(h, w) / min(h, w) <= 200]
    assert len(sizes) > 9000
    hs, ws = np.array(sizes).T
    for lo, hi in BOUNDS:
        ours = np.stack(smart_resize(hs, ws, 28, lo, hi), axis=1)
        bad = np.flatnonzero((ours != _ref_grids(sizes, lo, hi)).any(axis=1))
        assert not len(bad), [(sizes[i], tuple(ours[i])) for i in bad[:5]]


def test_vision_tokens_and_target_size_equal_transformers_grid():
    """The cost model's LLM tokens and the packer's resize both give the reference grid."""
    sizes = [(h, w) for h in range(1, 60) for w in (1, 7, 13, 14, 15, 27, 41, 150, 400, 1000)]
    sizes = [(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200]
    hs, ws = np.array(sizes).T
    for preset in ("qwen2.5-vl-vision", "qwen2.5-vl-vision-1280"):
        cfg = load_module(preset)
        ref = _ref_grids(sizes, cfg.min_pixels, cfg.max_pixels)
        got = vision_tokens(cfg, np.ones(len(sizes), np.int64), hs, ws).llm_tokens
        assert got.tolist() == (ref[:, 0] * ref[:, 1] // 28**2).tolist()
        vt = VisionTransform(cfg)
        assert [vt.target_size(h, w) for h, w in sizes] == [tuple(r) for r in ref.tolist()]


@pytest.mark.parametrize("h,w", [(14, 400), (10, 1500), (1, 150), (13, 400), (5, 1000), (200, 1)])
def test_thin_image_pixels_and_grid_equal_qwen2vl_processor(h, w):
    """Images with a side under 14 px: the packer's patches are the processor's, token for token."""
    rgb = np.random.default_rng(h * 7919 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    vt = VisionTransform(QWEN)
    raw, grid = vt.encode_image(decode.decode_image(buf.getvalue(), vt.target_size(h, w)))
    meta = {"pixel_mean": list(QWEN.image_mean), "pixel_std": list(QWEN.image_std),
            "temporal_patch": QWEN.temporal_patch}  # fmt: skip
    ours = normalize_pixels(torch.from_numpy(raw), meta, video=False).numpy()
    proc = Qwen2VLImageProcessorPil(
        min_pixels=QWEN.min_pixels, max_pixels=QWEN.max_pixels, patch_size=14,
        temporal_patch_size=2, merge_size=2, image_mean=list(QWEN.image_mean),
        image_std=list(QWEN.image_std), resample=Image.BICUBIC,
    )  # fmt: skip
    out = proc(images=Image.fromarray(rgb), return_tensors="np")
    assert tuple(int(x) for x in out["image_grid_thw"][0]) == grid
    assert vt.llm_tokens(h, w) == np.prod(grid) // 4
    np.testing.assert_allclose(ours, np.asarray(out["pixel_values"]), atol=2e-5)


def test_aspect_over_200_is_refused_as_the_processor_refuses_it():
    hf_smart_resize(1, 200, 28, 3136, 12845056)  # 200 is accepted ...
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_smart_resize(1, 201, 28, 3136, 12845056)  # ... 201 is not
    assert aspect_over_limit(np.array([1, 1, 3, 1000]), np.array([200, 201, 601, 4])).tolist() == [
        False, True, True, True,
    ]  # fmt: skip
    vt = VisionTransform(QWEN)
    vt.target_size(1, 200)
    with pytest.raises(InvalidInput, match="aspect ratio 201.0 is over 200"):
        vt.target_size(1, 201)
    with pytest.raises(InvalidInput, match="aspect ratio"):
        vt.target_size(4, 1000, frames=8)  # video frames too (qwen-vl-utils raises as well)
    # fixed-size and tiled encoders take any shape
    assert VisionTransform(load_module("siglip-so400m")).target_size(1, 201) == (384, 384)


def _png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (9, 99, 199)).save(buf, format="PNG")
    return buf.getvalue()


def test_aspect_over_200_at_serve_names_the_sample_and_skips(tmp_path):
    shard = write_shard(
        tmp_path / "a.tar",
        {"ok": {"png": _png(40, 60), "txt": b"fine"}, "strip": {"png": _png(1, 300), "txt": b"x"}},
    )
    index = write_index(build_index(str(shard), progress=False), tmp_path / "i.parquet")
    model = ModelSpec(encoders=(QWEN,), llm=load_module("llama-3.2-1b"))
    with pytest.raises(SampleError, match="aspect ratio 300.0") as err:
        make_packer(str(index), model=model)([0, 1], [0, 1])
    assert err.value.key == "strip" and err.value.source == str(shard)
    for enc, llm in (([0, 1], [0, 1]), ([], [0, 1])):  # an LLM-only pack skips it too
        out = make_packer(str(index), model=model, on_error="skip")(enc, llm)
        assert out.llm_keys == ["ok"] and [s["key"] for s in out.skipped] == ["strip"]


def _reference_audio_lengths(cfg, frames: np.ndarray) -> np.ndarray:
    """The preset's reference encoder output length for one window of ``frames`` mel frames."""
    f = torch.from_numpy(frames)
    if cfg.audio_pool == 1 and cfg.audio_conv_stride == 2:
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        return WhisperEncoder._get_feat_extract_output_lengths(None, f).numpy()
    if cfg.audio_pool == 2 and cfg.audio_conv_stride == 2:
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

        return Qwen2AudioEncoder._get_feat_extract_output_lengths(None, f)[1].numpy()
    pytest.skip(f"{cfg.name}: no transformers encoder with conv stride {cfg.audio_conv_stride}, "
                f"pool {cfg.audio_pool}")  # fmt: skip


@pytest.mark.parametrize("pool", [None, 1])
@pytest.mark.parametrize("preset", AUDIO_PRESETS)
def test_audio_tokens_equal_transformers_output_lengths(preset, pool):
    """Every clip of 1..480,000 samples (30 s at 16 kHz), read back from the float32 an index stores,
    then long clips (per 30 s window, each padded and masked) up to 600 s.

    The preset's own pooling (whisper-large-v3-encoder: Qwen2-Audio's) and plain Whisper (pool 1).
    """
    cfg = load_module(preset)
    cfg = cfg if pool is None else replace(cfg, audio_pool=pool)
    n = np.arange(1, 480_001, dtype=np.int64)
    frames = -(-n // 160)  # WhisperFeatureExtractor's mask (checked below)
    sec32 = (n / 16000).astype(np.float32)
    ours = audio_tokens(cfg, sec32).llm_tokens
    ref = _reference_audio_lengths(cfg, frames)
    bad = np.flatnonzero(ours != ref)
    assert not len(bad), [(int(n[i]), int(ours[i]), int(ref[i])) for i in bad[:5]]
    long = np.random.default_rng(1).integers(480_001, 600 * 16000, 20_000)
    long_frames = -(-long // 160)
    full, rest = np.divmod(long_frames, 3000)
    ref_long = full * _reference_audio_lengths(cfg, np.array([3000]))[0] + np.where(
        rest > 0, _reference_audio_lengths(cfg, np.maximum(rest, 1)), 0
    )
    ours_long = audio_tokens(cfg, (long / 16000).astype(np.float32)).llm_tokens
    assert np.array_equal(ours_long, ref_long)


def test_mel_frames_equal_feature_extractor_mask_and_survive_float32():
    """Frames = WhisperFeatureExtractor's attention-mask count; float32 seconds of clips up to 500 s
    (past the ~16 s where a microsecond grid let one frame slip) land back on the 16 kHz grid."""
    from transformers import WhisperFeatureExtractor

    cfg = load_module("whisper-large-v3-encoder")
    at = AudioTransform(cfg)
    fe = WhisperFeatureExtractor(feature_size=cfg.n_mels)
    for n in (1, 159, 160, 161, 3200, 48_160, 255_840, 479_841, 480_000):
        mask = fe(np.zeros(n, np.float32), sampling_rate=16000, return_attention_mask=True,
                  return_tensors="np")["attention_mask"]  # fmt: skip
        sec = float(np.float32(n / 16000))
        assert at.frames(sec) == int(mask.sum()) == -(-n // 160), n
        assert at.features(np.zeros(n, np.float32), sec).shape == (int(mask.sum()), cfg.n_mels)
    # whole frames from 16 s to 500 s: float32 rounds about half of them up, past the boundary
    edges = np.arange(1600, 50_000, 97) * 160
    got = [at.frames(float(s)) for s in (edges / 16000).astype(np.float32)]
    assert got == (edges // 160).tolist()
    n = np.random.default_rng(2).integers(16 * 16000, 500 * 16000, 50_000)
    n = np.concatenate([n, np.arange(1, 50_000) * 160, np.arange(1, 50_000) * 160 + 1])
    assert np.array_equal(audio_frames(cfg, (n / 16000).astype(np.float32)), -(-n // 160))
