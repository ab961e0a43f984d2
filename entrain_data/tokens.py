"""Raw sizes (pixels, frames, seconds) to tokens, for a given encoder, vectorised over items.

Each function mirrors the published preprocessing of the model family, so the
token counts (and so the attention sequence lengths) are the ones training
sees: transformers' Qwen2-VL ``smart_resize`` for dynamic resolution, InternVL
dynamic tiling for tiles, a fixed resize for SigLIP/CLIP-style encoders,
Whisper's padded 30 s windows and the encoders' output-length formulas (Whisper,
Qwen2-Audio) for audio; tests/test_token_reference.py checks them against
transformers. Every function returns an :class:`ItemTokens` whose arrays are per
item (image, video clip, audio clip).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .presets import ModuleConfig

__all__ = [
    "ItemTokens",
    "vision_tokens",
    "audio_tokens",
    "audio_seconds_grid",
    "smart_resize",
    "aspect_over_limit",
    "MAX_ASPECT",
    "AUDIO_SAMPLE_RATE",
    "audio_frames",
    "dynamic_pixel_bounds",
    "internvl_tiles",
]


@dataclass(frozen=True)
class ItemTokens:
    """Per item: attended sequences and their lengths, and what reaches the LLM.

    ``n_seq`` sequences of ``seq_len`` tokens each attend within themselves
    (frames groups, tiles, audio windows); ``window_sumsq`` is the sum of
    squared attention-window lengths in window-attention layers (equal to
    ``n_seq * seq_len**2`` when the encoder has no window attention).
    """

    n_seq: np.ndarray  # int64
    seq_len: np.ndarray  # int64
    window_sumsq: np.ndarray  # float64
    llm_tokens: np.ndarray  # int64
    embed_units: np.ndarray  # float64: patches (vision) or 30 s windows (audio) through the stem

    @property
    def encoder_tokens(self) -> np.ndarray:
        return self.n_seq * self.seq_len

    @property
    def full_sumsq(self) -> np.ndarray:
        return self.n_seq.astype(np.float64) * self.seq_len.astype(np.float64) ** 2


MAX_ASPECT = 200
"""Largest long/short side ratio Qwen2-VL's ``smart_resize`` accepts (transformers raises above)."""


def smart_resize(
    height: np.ndarray,
    width: np.ndarray,
    factor: int,
    min_pixels: int | np.ndarray,
    max_pixels: int | np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Qwen2-VL ``smart_resize`` on arrays: sides multiples of ``factor``, area in bounds.

    Its steps in its order: round each side to the factor (a side under factor/2 rounds to 0, and
    the zero area then takes the min_pixels branch); too large: scale down by sqrt(area / max) and
    floor (at least one factor); too small: scale up and ceil. The aspect limit (:data:`MAX_ASPECT`)
    is not checked here, so a profile never stops on one sample: the packer refuses such an item
    (:meth:`VisionTransform.target_size`), naming the sample, as the processor raises.
    """
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    hb = np.round(h / factor) * factor  # numpy and Python both round half to even
    wb = np.round(w / factor) * factor
    area = hb * wb
    big = area > max_pixels
    small = ~big & (area < min_pixels)
    with np.errstate(divide="ignore", invalid="ignore"):
        beta_big = np.sqrt(h * w / max_pixels)
        beta_small = np.sqrt(min_pixels / (h * w))
    hb = np.where(big, np.maximum(factor, np.floor(h / beta_big / factor) * factor), hb)
    wb = np.where(big, np.maximum(factor, np.floor(w / beta_big / factor) * factor), wb)
    hb = np.where(small, np.ceil(h * beta_small / factor) * factor, hb)
    wb = np.where(small, np.ceil(w * beta_small / factor) * factor, wb)
    return hb.astype(np.int64), wb.astype(np.int64)


def aspect_over_limit(height: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Items Qwen2-VL's processor refuses: long side over :data:`MAX_ASPECT` times the short one."""
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.maximum(h, w) / np.minimum(h, w) > MAX_ASPECT


def internvl_tiles(
    height: np.ndarray, width: np.ndarray, image_size: int, max_tiles: int
) -> np.ndarray:
    """Tile count of InternVL's ``dynamic_preprocess`` (closest aspect ratio, 1..max_tiles tiles).

    Candidates (i, j) with i * j <= max_tiles are visited in the reference's
    order (by tile count); a later candidate with the same ratio error wins when
    the image area exceeds half of its tiles' area, as in the reference.
    """
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    ratio = w / h
    area = w * h
    cands = sorted(
        {
            (i, j)
            for n in range(1, max_tiles + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if i * j <= max_tiles
        },
        key=lambda x: x[0] * x[1],
    )
    best_diff = np.full(h.shape, np.inf)
    best_n = np.ones(h.shape, dtype=np.int64)
    for i, j in cands:
        diff = np.abs(ratio - i / j)
        take = (diff < best_diff) | (
            (diff == best_diff) & (area > 0.5 * image_size * image_size * i * j)
        )
        best_diff = np.where(diff < best_diff, diff, best_diff)
        best_n = np.where(take, i * j, best_n)
    return best_n


def _window_sumsq(grid_h: np.ndarray, grid_w: np.ndarray, window: int) -> np.ndarray:
    """Sum over square windows of (tokens in window)^2 for a grid tiled by ``window``-sided windows.

    Windows tile rows and columns independently (the last ones partial), so the
    sum factorises: (sum of row-chunk sizes^2) * (sum of col-chunk sizes^2).
    """

    def chunks_sq(n: np.ndarray) -> np.ndarray:
        q, r = np.divmod(n, window)
        return q.astype(np.float64) * window * window + r.astype(np.float64) ** 2

    return chunks_sq(grid_h) * chunks_sq(grid_w)


def dynamic_pixel_bounds(cfg: ModuleConfig, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(min_pixels, max_pixels) of every item's frames under dynamic resolution.

    Images use the image processor's bounds. Video frames follow qwen-vl-utils' ``fetch_video``
    (what Qwen2-VL / Qwen2.5-VL train on): floor ``video_min_pixels`` (128*28*28 for Qwen), cap
    ``max(min(video_max_pixels, video_total_pixels / frames * temporal_patch), 1.05 * floor)``.
    The one rule the cost model, the worker transform and the bench model share.
    """
    frames = np.asarray(frames, dtype=np.int64)
    is_video = frames > 1
    vmin = float(cfg.video_min_pixels or cfg.min_pixels)
    vcap = np.full(frames.shape, float(min(cfg.video_max_pixels or cfg.max_pixels, cfg.max_pixels)))
    if cfg.video_total_pixels:
        vcap = np.minimum(vcap, cfg.video_total_pixels / np.maximum(frames, 1) * cfg.temporal_patch)
    vcap = np.maximum(vcap, vmin * 1.05 if cfg.video_min_pixels else vmin)
    min_px = np.where(is_video, vmin, float(cfg.min_pixels))
    max_px = np.where(is_video, vcap, float(cfg.max_pixels))
    return min_px, max_px


def vision_tokens(
    cfg: ModuleConfig, frames: np.ndarray, height: np.ndarray, width: np.ndarray
) -> ItemTokens:
    """Tokens of every vision item (image: frames == 1; video clip: its sampled frames)."""
    frames = np.asarray(frames, dtype=np.int64)
    p, m = cfg.patch_size, cfg.merge
    cls = 1 if cfg.cls_token else 0
    is_video = frames > 1
    if cfg.resize == "fixed":
        g = cfg.image_size // p
        groups = -(-frames // cfg.temporal_patch)
        n_seq = groups
        gh = np.full(frames.shape, g, dtype=np.int64)
        gw = gh
    elif cfg.resize == "tiles":
        g = cfg.image_size // p
        tiles = internvl_tiles(height, width, cfg.image_size, cfg.max_tiles)
        if cfg.thumbnail:
            tiles = np.where(tiles > 1, tiles + 1, tiles)
        tiles = np.where(is_video, frames, tiles)  # InternVL: one tile per video frame
        n_seq = tiles.astype(np.int64)
        gh = np.full(frames.shape, g, dtype=np.int64)
        gw = gh
    else:  # dynamic
        min_px, max_px = dynamic_pixel_bounds(cfg, frames)
        hb, wb = smart_resize(height, width, p * m, min_px, max_px)
        gh, gw = hb // p, wb // p
        n_seq = -(-frames // cfg.temporal_patch)
    seq_len = gh * gw + cls
    if cfg.window_patches > 0:
        k = max(cfg.window_patches // m, 1)
        wsq = n_seq * _window_sumsq(gh // m, gw // m, k) * float(m**4)
    else:
        wsq = n_seq.astype(np.float64) * seq_len.astype(np.float64) ** 2
    llm = n_seq * (gh // m) * (gw // m)
    embed_units = (n_seq * gh * gw).astype(np.float64)
    return ItemTokens(
        n_seq=n_seq.astype(np.int64),
        seq_len=seq_len.astype(np.int64),
        window_sumsq=wsq,
        llm_tokens=llm.astype(np.int64),
        embed_units=embed_units,
    )


AUDIO_SAMPLE_RATE = 16000
"""Whisper's input rate: the packer decodes every clip to it, and frames are counted on its grid."""


def audio_seconds_grid(seconds: Any) -> np.ndarray:
    """Durations snapped to the 16 kHz sample grid, as float64: the decoder resamples a clip to
    ``round(seconds * 16000)`` samples, and an index stores seconds as float32 (3,200 samples read
    back as 0.20000000298 s, one mel frame past the clip's 20). float32's error stays under half
    a sample up to about 500 s, so every clip of whole 16 kHz samples lands back on its count;
    a clip of another rate lands where the decoder's rounding puts it, save a duration within
    float32's error of a half-sample tie."""
    sec = np.asarray(seconds, dtype=np.float64)
    return np.round(sec * AUDIO_SAMPLE_RATE) / AUDIO_SAMPLE_RATE


def audio_frames(cfg: ModuleConfig, seconds: Any) -> np.ndarray:
    """Mel frames of every clip: ``ceil(samples / hop)`` (at least 1), the count of
    ``WhisperFeatureExtractor``'s attention mask; the packer's features have exactly these rows."""
    samples = np.round(np.asarray(seconds, dtype=np.float64) * AUDIO_SAMPLE_RATE).astype(np.int64)
    hop = max(1, int(round(AUDIO_SAMPLE_RATE / cfg.audio_frame_rate)))
    return np.maximum(1, -(-samples // hop))


def _audio_output_length(cfg: ModuleConfig, frames: np.ndarray) -> np.ndarray:
    """Encoder outputs of one window's ``frames``, transformers' formulas: the conv stem (kernel 3,
    padding 1, stride s) gives ``(L - 1) // s + 1`` (``WhisperEncoder._get_feat_extract_output_lengths``),
    then ``audio_pool`` average pooling (kernel = stride = pool) ``(L - pool) // pool + 1 == L // pool``
    (``Qwen2AudioEncoder``'s). A clip of one or two frames gives Qwen2-Audio 0 tokens, as here."""
    conv = (np.asarray(frames, dtype=np.int64) - 1) // int(cfg.audio_conv_stride) + 1
    return conv // int(cfg.audio_pool)


def audio_tokens(cfg: ModuleConfig, seconds: np.ndarray) -> ItemTokens:
    """Tokens of every audio clip: padded fixed windows through the encoder, real length into the LLM.

    A clip longer than one window runs as consecutive windows, each padded and masked on its own,
    so its LLM tokens are the reference's output length summed over its windows.
    """
    frames = audio_frames(cfg, seconds)
    win_frames = max(1, int(round(cfg.audio_window_seconds * cfg.audio_frame_rate)))
    full, rest = np.divmod(frames, win_frames)
    n_win = np.maximum(1, full + (rest > 0)).astype(np.int64)
    seq = int(round(cfg.audio_window_seconds * cfg.audio_frame_rate / cfg.audio_conv_stride))
    seq_len = np.full(frames.shape, seq, dtype=np.int64)
    llm = full * _audio_output_length(cfg, np.array(win_frames)) + np.where(
        rest > 0, _audio_output_length(cfg, rest), 0
    )
    return ItemTokens(
        n_seq=n_win,
        seq_len=seq_len,
        window_sumsq=n_win * float(seq) ** 2,
        llm_tokens=llm.astype(np.int64),
        embed_units=n_win.astype(np.float64),
    )
