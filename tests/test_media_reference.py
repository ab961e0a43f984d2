"""Every vision/audio preset against the preprocessor users run: ``transformers``' own processors.

Each processor is constructed locally from the preset's parameters (no download). Real images,
audio and video from ../shared/data go through our decode + transform (uint8 patches) and
``Microbatch``'s device-side normalisation; the result must equal the processor's pixels to float
tolerance, and the patch grids must give the cost model's token counts.

The PIL backends of the image processors run here (``*ImageProcessorPil``; torchvision is not
installable beside torch 2.13.0 CPU: torchvision 0.29.1 from PyPI fails at import with
``RuntimeError: operator torchvision::nms does not exist``). ``Qwen2VLVideoProcessor`` imports
torchvision at module level, so it cannot run: the video test takes the frames the video
processor's ``sample_frames`` picks (its formula), resizes and normalises each with
``Qwen2VLImageProcessorPil``'s own ``resize``/``rescale``/``normalize`` and lays them out with the
video processor's ``patchify`` permutation, transcribed. The frame size is the cost model's video
rule, checked against qwen-vl-utils' rule (see ``qwen_vl_utils_size``).
"""

from __future__ import annotations

import io
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from entrain_data.workers import decode
from entrain_data.workers.transforms import AudioTransform, VisionTransform, tile_canvas

from entrain_data.batch import normalize_pixels
from entrain_data.presets import ModuleConfig, load_module
from entrain_data.tokens import internvl_tiles, vision_tokens

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    GotOcr2ImageProcessorPil,
    Qwen2VLImageProcessorPil,
    SiglipImageProcessorPil,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder  # noqa: E402

pytestmark = pytest.mark.shared_data

VISION_PRESETS = ("siglip-so400m", "internvit-300m", "qwen2.5-vl-vision", "qwen2.5-vl-vision-1280")
# real files of every kind the decoder meets: photos, odd sizes, alpha, palette, grey, 16-bit, CMYK
IMAGES = (
    "coco_mini/images/000000000139.jpg",
    "images_misc/img2dataset/123_456.jpg",
    "images_misc/img2dataset/456_123.jpg",
    "images_misc/matplotlib/logo2.png",
    "images_misc/hf_datasets/test_image_rgba.png",
    "images_misc/pillow/hopper.gif",
    "images_misc/pillow/16bit.cropped.tif",
    "images_misc/pillow/pil_sample_cmyk.jpg",
    "images_misc/pillow/uncompressed_la.png",
    "images_misc/skimage/page.png",
    "images_misc/skimage/text.png",
    "images_misc/skimage/hubble_deep_field.jpg",  # 1000x872: the 1280-token cap bites
)
LARGE = ("images_misc/pillow/itxt_chunks.png",)  # 2400x2000: 12 tiles, 6K Qwen tokens (slow)
VIDEOS = ("1.mp4", "3.mp4", "4.mp4", "2.avi")
FAST_VIDEOS = ("3.mp4", "2.avi")  # one above, one below 128*28*28 px; all four when slow


def meta_of(cfg: ModuleConfig) -> dict:
    return {
        "pixel_mean": list(cfg.image_mean),
        "pixel_std": list(cfg.image_std),
        "temporal_patch": cfg.temporal_patch,
    }


def ours_image(cfg: ModuleConfig, data: bytes) -> tuple[np.ndarray, tuple, np.ndarray]:
    """The packer's steps: header size -> decode at the target -> uint8 patches -> device floats."""
    vt = VisionTransform(cfg)
    h, w = decode.image_size(data)
    raw, grid = vt.encode_image(decode.decode_image(data, vt.target_size(h, w)))
    floats = normalize_pixels(torch.from_numpy(raw), meta_of(cfg), video=False).numpy()
    return floats, grid, raw


def unpatchify(rows: np.ndarray, grid: tuple, p: int, m: int, tp: int) -> np.ndarray:
    """Qwen2-VL-layout rows [gt*gh*gw, C*tp*p*p] -> [gt, tp, C, gh*p, gw*p]."""
    gt, gh, gw = grid
    c = rows.shape[1] // (tp * p * p)
    x = rows.reshape(gt, gh // m, gw // m, m, m, c, tp, p, p)
    return x.transpose(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(gt, tp, c, gh * p, gw * p)


def cost_tokens(cfg: ModuleConfig, h: int, w: int, frames: int = 1) -> int:
    return int(vision_tokens(cfg, np.array([frames]), np.array([h]), np.array([w])).llm_tokens[0])


def processor(cfg: ModuleConfig):
    """The published processor of the preset's family, from the preset's own parameters."""
    common = {
        "image_mean": list(cfg.image_mean),
        "image_std": list(cfg.image_std),
        "resample": Image.BICUBIC,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    if cfg.resize == "fixed":
        return SiglipImageProcessorPil(
            size={"height": cfg.image_size, "width": cfg.image_size}, **common
        )
    if cfg.resize == "tiles":
        return GotOcr2ImageProcessorPil(
            size={"height": cfg.image_size, "width": cfg.image_size},
            crop_to_patches=True,
            min_patches=1,
            max_patches=cfg.max_tiles,
            **common,
        )
    return Qwen2VLImageProcessorPil(
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch,
        merge_size=cfg.merge,
        **common,
    )


def reference_image(cfg: ModuleConfig, data: bytes) -> tuple[np.ndarray, int]:
    """The processor's pixels in our row layout and its LLM token count."""
    with Image.open(io.BytesIO(data)) as im:
        out = processor(cfg)(images=im, return_tensors="np")
    pv = np.asarray(out["pixel_values"], dtype=np.float32)
    p, m = cfg.patch_size, cfg.merge
    if cfg.resize == "dynamic":  # already in rows: [P, C*tp*p*p]
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return pv, int(np.prod(grid)) // (m * m)
    g = cfg.image_size // p  # fixed/tiles: [N, C, S, S] images; the encoder sees g*p of each side
    tiles = pv[:, :, : g * p, : g * p]
    return tiles, tiles.shape[0] * (g // m) ** 2


@pytest.mark.parametrize(
    "preset,images",
    [(p, IMAGES) for p in VISION_PRESETS]
    + [pytest.param(p, LARGE, marks=pytest.mark.slow, id=f"{p}-large") for p in VISION_PRESETS],
)
def test_vision_preset_matches_transformers_processor(preset, images, shared_data):
    cfg = load_module(preset)
    p, m = cfg.patch_size, cfg.merge
    for rel in images:
        data = (shared_data / rel).read_bytes()
        h, w = decode.image_size(data)
        floats, grid, raw = ours_image(cfg, data)
        ref, ref_tokens = reference_image(cfg, data)
        tokens = int(np.prod(grid)) // (m * m)
        assert tokens == ref_tokens == cost_tokens(cfg, h, w), (preset, rel, grid)
        # the wire holds the encoder's uint8 pixels: one copy per still image, nothing more
        assert raw.dtype == np.uint8 and raw.nbytes == np.prod(grid) * 3 * p * p
        if cfg.resize == "dynamic":
            assert floats.shape == ref.shape, (preset, rel)
            np.testing.assert_allclose(floats, ref, atol=2e-5, err_msg=f"{preset} {rel}")
        else:
            img = unpatchify(floats, grid, p, m, cfg.temporal_patch)[:, 0]
            assert img.shape == ref.shape, (preset, rel)
            np.testing.assert_allclose(img, ref, atol=2e-5, err_msg=f"{preset} {rel}")


def test_siglip_remainder_dropped_not_an_error(shared_data):
    """so400m-patch14-384: 384 = 27 * 14 + 6, the conv drops the last 6 rows/columns."""
    cfg = load_module("siglip-so400m")
    data = (shared_data / IMAGES[0]).read_bytes()
    _, grid, raw = ours_image(cfg, data)
    assert grid == (1, 27, 27) and raw.shape == (729, 3 * 14 * 14)
    # wire bytes <= 1.05x the uint8 pixels the processor hands the encoder (384 * 384 * 3)
    assert raw.nbytes <= 1.05 * 384 * 384 * 3


def test_internvl_tiling_agrees_with_cost_model():
    """The tile canvas (HF's get_optimal_tiled_canvas) has the cost model's tile count."""
    rng = np.random.default_rng(0)
    hs = np.concatenate([rng.integers(1, 5000, 400), [448, 896, 100, 2000, 1, 4000]])
    ws = np.concatenate([rng.integers(1, 5000, 400), [448, 448, 3000, 2400, 7, 10]])
    for max_tiles in (1, 6, 12):
        want = internvl_tiles(hs, ws, 448, max_tiles)
        got = [math.prod(tile_canvas(int(h), int(w), 448, max_tiles)) for h, w in zip(hs, ws)]
        assert got == want.tolist()


def test_whisper_features_match_feature_extractor(shared_data):
    cfg = load_module("whisper-large-v3-encoder")
    at = AudioTransform(cfg)
    fe = WhisperFeatureExtractor(
        feature_size=cfg.n_mels, sampling_rate=16000, hop_length=at.hop, chunk_length=30, n_fft=400
    )
    files = sorted((shared_data / "audio_misc" / "ljspeech" / "wavs").glob("*.wav"))[:3]
    files += [shared_data / "audio_misc" / "whisper" / "jfk.flac"]
    files += [shared_data / "mllm_demo" / "mllm_demo_data" / "2.wav"]
    assert len(files) >= 3
    for path in files:
        data = path.read_bytes()
        sec = float(np.float32(decode.audio_seconds(data)))  # the index stores float32 seconds
        wave = decode.decode_audio(data, 16000)
        ours = at.features(wave, sec)
        out = fe(wave, sampling_rate=16000, return_attention_mask=True, return_tensors="np")
        ref = out["input_features"][0]
        assert ours.shape == (at.frames(sec), cfg.n_mels) and ref.shape == (cfg.n_mels, 3000)
        k = min(len(ours), 3000)
        np.testing.assert_allclose(ours[:k], ref[:, :k].T, atol=1e-4, err_msg=str(path))
        # the preset pools as Qwen2-Audio does: its encoder's output length of the masked frames
        assert len(ours) <= 3000 and int(out["attention_mask"].sum()) == len(ours)
        _, n_out = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(len(ours)))
        assert int(n_out) == at.llm_tokens(sec), path


QWEN_VL_UTILS_VIDEO_MIN_PIXELS = 128 * 28 * 28


def reference_video(cfg: ModuleConfig, path: Path, frames: int) -> tuple[np.ndarray, tuple]:
    """Qwen2-VL's video pipeline with the pieces that run here (module doc).

    ``fixed``/``tiles`` presets: each sampled frame resized to one ``image_size`` square by the
    preset's processor (InternVL's video frames are single tiles), laid out the same way.
    """
    from transformers.image_utils import SizeDict

    with av.open(str(path)) as c:
        all_frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    total = len(all_frames)
    picks = torch.arange(0, total, total / frames).int().tolist()  # its sample_frames
    h, w = all_frames[0].shape[:2]
    th, tw = VisionTransform(cfg).target_size(h, w, frames)
    proc = processor(cfg)
    out = []
    for i in picks:
        x = all_frames[i].transpose(2, 0, 1)
        if cfg.resize == "dynamic":  # bounds of qwen-vl-utils' fetch_video, not ours
            lo = QWEN_VL_UTILS_VIDEO_MIN_PIXELS
            cap = max(
                min(cfg.video_max_pixels, cfg.video_total_pixels / frames * 2), int(lo * 1.05)
            )
            x = proc.resize(
                x,
                size=SizeDict(shortest_edge=lo, longest_edge=min(cap, cfg.max_pixels)),
                resample=Image.BICUBIC,
                factor=cfg.patch_size * cfg.merge,
            )
        else:
            x = proc.resize(x, size=SizeDict(height=th, width=tw), resample=Image.BICUBIC)
        assert x.shape[1:] == (th, tw)
        x = proc.normalize(proc.rescale(x, 1 / 255), list(cfg.image_mean), list(cfg.image_std))
        out.append(torch.from_numpy(np.asarray(x, dtype=np.float32)))
    tp, p, m = cfg.temporal_patch, cfg.patch_size, cfg.merge
    gh, gw = th // (p * m) * m, tw // (p * m) * m  # fixed: 384 -> 27 patches, remainder dropped
    v = torch.stack(out)[None, :, :, : gh * p, : gw * p]  # [1, T, C, H, W]; its patchify:
    if pad := -v.shape[1] % tp:
        v = torch.cat((v, v[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    gt = v.shape[1] // tp
    v = v.reshape(1, gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return v.reshape(gt * gh * gw, 3 * tp * p * p).numpy(), (gt, gh, gw)


def qwen_vl_utils_size(cfg: ModuleConfig, info: decode.VideoInfo, frames: int) -> tuple[int, int]:
    """A frame's size by qwen-vl-utils' ``fetch_video`` rule (VIDEO_MIN_PIXELS 128*28*28, per-frame
    cap ``max(min(VIDEO_MAX_PIXELS, total / frames * 2), 1.05 * min))``, HF's ``smart_resize``).

    The cost model and the worker transform follow the same rule (``tokens.dynamic_pixel_bounds``),
    small clips (2.avi, 320x240) included.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    lo = QWEN_VL_UTILS_VIDEO_MIN_PIXELS
    cap = max(min(cfg.video_max_pixels, cfg.video_total_pixels / frames * 2), int(lo * 1.05))
    return smart_resize(info.height, info.width, 28, lo, min(cap, cfg.max_pixels))


@pytest.mark.parametrize(
    "preset,videos",
    [("qwen2.5-vl-vision", FAST_VIDEOS)]
    + [
        pytest.param(p, VIDEOS, marks=pytest.mark.slow, id=f"{p}-all")
        for p in ("qwen2.5-vl-vision", "qwen2.5-vl-vision-1280")
    ],
)
def test_video_matches_qwen2vl_video_pipeline(preset, videos, shared_data):
    cfg = load_module(preset)
    vt = VisionTransform(cfg)
    root = shared_data / "mllm_demo" / "mllm_demo_data"
    for name in videos:
        data = (root / name).read_bytes()
        info = decode.probe_video(data)
        frames = decode.sampled_frames(info.seconds)
        assert frames == min(max(round(info.seconds), 4), 64)  # 1 fps, 4..64 frames
        clip = decode.decode_video(data, frames, vt.target_size(info.height, info.width, frames))
        raw, grid = vt.encode_video(clip)
        assert raw.dtype == np.uint8 and raw.shape[1] == 3 * cfg.temporal_patch * 14 * 14
        floats = normalize_pixels(torch.from_numpy(raw), meta_of(cfg), video=True).numpy()
        ref, ref_grid = reference_video(cfg, root / name, frames)
        assert grid == ref_grid and grid[0] == -(-frames // cfg.temporal_patch)
        assert (grid[1] * 14, grid[2] * 14) == qwen_vl_utils_size(cfg, info, frames), name
        assert np.prod(grid) // 4 == cost_tokens(cfg, info.height, info.width, frames)
        np.testing.assert_allclose(floats, ref, atol=2e-5, err_msg=name)


def test_video_probe_reads_headers_only(shared_data):
    """Header figures: duration, fps, size, frame count of every demo clip."""
    root = shared_data / "mllm_demo" / "mllm_demo_data"
    got = {n: decode.probe_video((root / n).read_bytes()) for n in VIDEOS}
    assert (got["4.mp4"].height, got["4.mp4"].width, got["4.mp4"].seconds) == (224, 224, 5.0)
    assert (got["2.avi"].height, got["2.avi"].width) == (240, 320)
    for info in got.values():
        assert info.fps > 0 and info.frames > 0 and info.seconds > 1
    with pytest.raises(ValueError, match="video"):
        decode.probe_video(b"not a video at all")


def test_fixed_and_tiles_video_frames(shared_data):
    """SigLIP: each frame one 384 image; InternVL: each frame one 448 tile (the cost model's rule)."""
    path = shared_data / "mllm_demo" / "mllm_demo_data" / "4.mp4"
    data = path.read_bytes()
    info = decode.probe_video(data)
    n = decode.sampled_frames(info.seconds)
    for preset in ("siglip-so400m", "internvit-300m"):
        cfg = load_module(preset)
        vt = VisionTransform(cfg)
        clip = decode.decode_video(data, n, vt.target_size(info.height, info.width, n))
        raw, grid = vt.encode_video(clip)
        g = cfg.image_size // cfg.patch_size
        assert grid == (n, g, g)
        assert np.prod(grid) // cfg.merge**2 == cost_tokens(cfg, info.height, info.width, n)
        floats = normalize_pixels(torch.from_numpy(raw), meta_of(cfg), video=True).numpy()
        ref, ref_grid = reference_video(cfg, path, n)
        assert ref_grid == grid
        np.testing.assert_allclose(floats, ref, atol=2e-5, err_msg=preset)


def test_bad_config_is_one_clear_error():
    cfg = load_module("qwen2.5-vl-vision")
    from entrain_data.errors import InvalidInput

    with pytest.raises(InvalidInput, match="in_channels"):
        VisionTransform(replace(cfg, in_channels=1, image_mean=(0.5,), image_std=(0.5,)))
    with pytest.raises(InvalidInput, match="image_std"):
        replace(cfg, image_std=(0.5, 0.0, 0.5))
