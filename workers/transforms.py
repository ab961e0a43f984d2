"""Default encoder-input transforms: the published preprocessors, token for token and pixel for pixel.

Public API (stable):

- ``VisionTransform(cfg)`` for a vision :class:`~entrain_data.presets.ModuleConfig`, one of the
  three resize policies of the cost model (:mod:`entrain_data.tokens`):

  - ``fixed`` (SigLIP / CLIP): every image or frame resized to ``image_size`` square; the patch
    grid is ``image_size // patch_size`` per side and the remainder (384 = 27 * 14 + 6) is dropped,
    as the encoder's strided convolution drops it;
  - ``dynamic`` (Qwen2-VL / Qwen2.5-VL): transformers' ``smart_resize`` to multiples of
    patch*merge within [min_pixels, max_pixels] (video frames: the per-frame and per-clip caps of
    the cost model); an aspect ratio over 200 is refused, as the processor refuses it;
  - ``tiles`` (InternVL): the closest tile canvas of at most ``max_tiles`` ``image_size`` tiles,
    the image resized onto it and cut row by row, plus a thumbnail (the whole image resized to one
    tile) when there is more than one tile; a video frame is one tile.

  ``target_size(h, w, frames)`` is the size the decoder resizes an image or frame to (``tiles``
  images keep their size: tiles and thumbnail are both cut from the original);
  ``encode_image(rgb) -> (uint8 [P, C*p*p], grid (t, h, w))`` and
  ``encode_video(frames) -> (uint8 [P, C*tp*p*p], grid)`` give the patches in Qwen2-VL's
  flattened layout (merge windows contiguous; a video's ``temporal_patch`` frames interleaved per
  patch, the last frame repeated to fill a group, as Qwen2-VL's video processor does), as uint8:
  the float conversion and normalisation run on the training device (:meth:`Microbatch.to`), a
  still image's temporal repetition too. ``llm_tokens(h, w, frames)`` is the cost model's count.
- ``AudioTransform(cfg)``: Whisper's log-mel features (``cfg.n_mels`` mels, 25 ms Hann window,
  ``cfg.audio_frame_rate`` frames per second at 16 kHz, each ``audio_window_seconds`` window
  zero-padded and scaled on its own as ``WhisperFeatureExtractor`` does): ``frames(seconds)``,
  ``features(wave, seconds) -> float32 [frames(seconds), n_mels]``, ``llm_tokens(seconds)`` (the
  encoder's output length per window: Whisper's conv stem, then ``audio_pool``, as Qwen2-Audio).

The sizes used are the index's (metadata), never the decoded ones, so an LLM-only pack (a deferred
sample, not decoded) computes the same placeholder counts as the microbatch that encoded it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
from PIL import Image

from entrain_data.errors import InvalidInput
from entrain_data.presets import ModuleConfig
from entrain_data.tokens import (
    AUDIO_SAMPLE_RATE,
    MAX_ASPECT,
    aspect_over_limit,
    audio_frames,
    audio_tokens,
    dynamic_pixel_bounds,
    smart_resize,
    vision_tokens,
)

__all__ = ["VisionTransform", "AudioTransform", "SAMPLE_RATE", "tile_canvas", "resize_rgb"]

SAMPLE_RATE = AUDIO_SAMPLE_RATE  # the rate the cost model counts frames at


def tile_canvas(height: int, width: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of InternVL's tiling (``get_optimal_tiled_canvas`` of its HF processor).

    The closest aspect ratio among canvases of 1..max_tiles tiles, visited by tile count; on a tie
    the larger canvas wins while the image covers more than half of it. The count equals
    :func:`entrain_data.tokens.internvl_tiles` (tested).
    """
    cands = sorted(
        (
            (c, r)
            for c in range(1, max_tiles + 1)
            for r in range(1, max_tiles + 1)
            if c * r <= max_tiles
        ),
        key=lambda x: x[0] * x[1],
    )
    ratio, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for c, r in cands:
        diff = abs(ratio - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile * tile * c * r:
            best = (c, r)
    return best


def resize_rgb(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] resized with PIL's bicubic filter (what the published processors use)."""
    if rgb.shape[:2] == (height, width):
        return rgb
    im = Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8))
    return np.asarray(im.resize((int(width), int(height)), Image.BICUBIC), dtype=np.uint8)


def _patchify(frames: np.ndarray, p: int, m: int, tp: int) -> tuple[np.ndarray, tuple]:
    """uint8 [T, H, W, C] -> ([gt*gh*gw, C*tp*p*p], (gt, gh, gw)) in Qwen2-VL's layout.

    H and W are cut to multiples of p*m (the remainder is what a strided patch embedding drops);
    T is filled to a multiple of ``tp`` by repeating the last frame.
    """
    t, h, w, c = frames.shape
    gh, gw = (h // (p * m)) * m, (w // (p * m)) * m
    if gh < 1 or gw < 1:
        raise InvalidInput(f"image of {h}x{w} is smaller than one {p * m}-pixel patch window")
    x = frames[:, : gh * p, : gw * p]
    if t % tp:
        x = np.concatenate([x, np.repeat(x[-1:], tp - t % tp, axis=0)])
    gt = x.shape[0] // tp
    x = x.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c)
    # -> [gt, gh/m, gw/m, m, m, C, tp, p, p]
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


class VisionTransform:
    """Resize and patch layout of one vision encoder config (see module doc)."""

    def __init__(self, cfg: ModuleConfig) -> None:
        if cfg.kind != "vision":
            raise InvalidInput(f"module {cfg.name!r}: VisionTransform needs a vision module")
        if cfg.resize not in ("dynamic", "fixed", "tiles"):
            raise InvalidInput(
                f"module {cfg.name!r}: the default vision transform supports resize 'dynamic', "
                f"'fixed' and 'tiles', not {cfg.resize!r}; pass a transform of your own"
            )
        if cfg.in_channels != 3:
            raise InvalidInput(
                f"module {cfg.name!r}: the default vision transform decodes RGB (in_channels 3), "
                f"the module has in_channels {cfg.in_channels}"
            )
        if cfg.resize in ("fixed", "tiles") and cfg.image_size < cfg.patch_size * cfg.merge:
            raise InvalidInput(
                f"module {cfg.name!r}: field 'image_size' {cfg.image_size} is smaller than "
                f"patch_size*merge = {cfg.patch_size * cfg.merge}"
            )
        self.cfg = cfg
        self.patch = cfg.patch_size
        self.merge = cfg.merge
        self.tp = cfg.temporal_patch
        self.channels = cfg.in_channels

    @property
    def patch_dim(self) -> int:
        """Width of a patch row after :meth:`Microbatch.to` (float, temporal patch filled)."""
        return self.channels * self.tp * self.patch * self.patch

    def target_size(self, height: int, width: int, frames: int = 1) -> tuple[int, int]:
        """(H, W) the decoder resizes an image (or every frame of a clip) to.

        ``dynamic``: an item whose long side is over 200 times its short one is refused
        (``InvalidInput``; the packer names the sample, so ``on_error="skip"`` skips it), as
        transformers' Qwen2-VL processor raises; the cost model still counts it by the formula.
        """
        c = self.cfg
        if c.resize == "fixed" or (c.resize == "tiles" and frames > 1):
            return c.image_size, c.image_size
        if c.resize == "tiles":
            return int(height), int(width)
        if aspect_over_limit(np.array([height]), np.array([width]))[0]:
            raise InvalidInput(
                f"image of {height}x{width} px: aspect ratio {max(height, width) / min(height, width):.1f}"
                f" is over {MAX_ASPECT}, which Qwen2-VL's smart_resize refuses"
            )
        min_px, max_px = dynamic_pixel_bounds(c, np.array([frames]))
        h, w = smart_resize(
            np.array([height]), np.array([width]), self.patch * self.merge, min_px, max_px
        )
        return int(h[0]), int(w[0])

    def llm_tokens(self, height: int, width: int, frames: int = 1) -> int:
        """Encoder output tokens (after merging) for an item of these sizes: the cost model's count."""
        t = vision_tokens(self.cfg, np.array([frames]), np.array([height]), np.array([width]))
        return int(t.llm_tokens[0])

    def encode_image(self, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """uint8 patches [P, C*p*p] of a still image at :meth:`target_size`, and its grid.

        ``tiles``: the tiles row by row, then the thumbnail; grid ``(tiles, g, g)``.
        """
        c = self.cfg
        if c.resize == "tiles":
            h, w = rgb.shape[:2]
            s = c.image_size
            cols, rows = tile_canvas(h, w, s, c.max_tiles)
            canvas = resize_rgb(rgb, rows * s, cols * s)
            tiles = [
                canvas[r * s : (r + 1) * s, k * s : (k + 1) * s]
                for r in range(rows)
                for k in range(cols)
            ]
            if c.thumbnail and len(tiles) > 1:
                tiles.append(resize_rgb(rgb, s, s))
            patches, (_, gh, gw) = _patchify(np.stack(tiles), self.patch, self.merge, 1)
            return patches, (len(tiles), gh, gw)
        if c.resize == "fixed":
            rgb = resize_rgb(rgb, c.image_size, c.image_size)
        return _patchify(rgb[None], self.patch, self.merge, 1)

    def encode_video(self, frames: Sequence[np.ndarray]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """uint8 patches [P, C*tp*p*p] of a clip's sampled frames (each at :meth:`target_size`)."""
        if not len(frames):
            raise InvalidInput("a video clip needs at least one frame")
        h, w = frames[0].shape[:2]
        if self.cfg.resize != "dynamic":
            h = w = self.cfg.image_size
        x = np.stack([resize_rgb(f, h, w) for f in frames])
        return _patchify(x, self.patch, self.merge, self.tp)


def _mel_filters(n_mels: int, n_fft: int, sample_rate: int) -> np.ndarray:
    """Slaney-style mel filterbank [n_mels, n_fft//2 + 1] (the scale Whisper's features use)."""

    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        lin = f / (200.0 / 3)
        log_part = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log_part, lin)

    def mel_to_hz(mel: np.ndarray) -> np.ndarray:
        lin = mel * (200.0 / 3)
        log_part = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
        return np.where(mel >= 15.0, log_part, lin)

    fft_freqs = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    mels = np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2)
    hz = mel_to_hz(mels)
    fdiff = np.diff(hz)
    ramps = hz[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (hz[2 : n_mels + 2] - hz[:n_mels]))[:, None]
    return weights


class AudioTransform:
    """Whisper log-mel features of one audio encoder config (16 kHz input)."""

    def __init__(self, cfg: ModuleConfig, sample_rate: int = SAMPLE_RATE) -> None:
        if cfg.kind != "audio":
            raise InvalidInput(f"module {cfg.name!r}: AudioTransform needs an audio module")
        if sample_rate != SAMPLE_RATE:  # frames and tokens are counted on the 16 kHz grid
            raise InvalidInput(
                f"module {cfg.name!r}: sample_rate={sample_rate!r}, but Whisper's features (and "
                f"the index's frame counts) are defined at {SAMPLE_RATE} Hz: resample the clip "
                "first, as WhisperFeatureExtractor requires"
            )
        self.cfg = cfg
        self.sample_rate = sample_rate
        self.hop = int(round(sample_rate / cfg.audio_frame_rate))
        # Whisper's 25 ms window; never shorter than the hop, so no sample is skipped at low rates
        self.n_fft = max(int(round(0.025 * sample_rate)), self.hop)
        self.n_mels = cfg.n_mels
        self.window_frames = max(1, int(round(cfg.audio_window_seconds * cfg.audio_frame_rate)))

    @cached_property
    def _filters(self) -> np.ndarray:
        return _mel_filters(self.n_mels, self.n_fft, self.sample_rate)

    @cached_property
    def _window(self) -> np.ndarray:
        return np.hanning(self.n_fft + 1)[:-1]

    def frames(self, seconds: float) -> int:
        """Mel frames of a clip, the cost model's (:func:`~entrain_data.tokens.audio_frames`):
        ``ceil(samples / hop)`` on the 16 kHz grid, as Whisper's feature extractor masks them."""
        return int(audio_frames(self.cfg, np.array([seconds]))[0])

    def llm_tokens(self, seconds: float) -> int:
        """Encoder output tokens of a clip: the cost model's count."""
        return int(audio_tokens(self.cfg, np.array([seconds])).llm_tokens[0])

    def _window_logmel(self, x: np.ndarray) -> np.ndarray:
        """[window_frames, n_mels] of one window, as WhisperFeatureExtractor computes it.

        The samples are zero-padded to the window, reflect-padded by n_fft/2 at both ends (centred
        frames), the last frame dropped; log10 with a 1e-10 floor, clamped to 8 below the window's
        maximum, then (x + 4) / 4.
        """
        n = self.window_frames * self.hop
        seg = np.zeros(n, dtype=np.float64)
        seg[: min(len(x), n)] = x[:n]
        pad = self.n_fft // 2
        seg = np.pad(seg, pad, mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(seg, self.n_fft)[:: self.hop]
        frames = frames[: self.window_frames]
        spec = np.abs(np.fft.rfft(frames * self._window, axis=1)) ** 2
        logmel = np.log10(np.maximum(spec @ self._filters.T, 1e-10))
        logmel = np.maximum(logmel, logmel.max() - 8.0)
        return ((logmel + 4.0) / 4.0).astype(np.float32)

    def features(self, wave: np.ndarray, seconds: float) -> np.ndarray:
        """float32 [frames(seconds), n_mels]: Whisper features of every window, cut to the clip."""
        n_frames = self.frames(seconds)
        x = np.asarray(wave, dtype=np.float32)
        out = np.zeros((n_frames, self.n_mels), dtype=np.float32)
        per = self.window_frames
        for start in range(0, n_frames, per):
            k = min(per, n_frames - start)
            out[start : start + k] = self._window_logmel(x[start * self.hop :])[:k]
        return out
