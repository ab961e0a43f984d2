"""Default encoder-input transforms, matching the cost model's encoders token for token.

Public API (stable):

- ``VisionTransform(cfg)``: for a vision :class:`~entrain_data.presets.ModuleConfig`:
  ``target_size(h, w) -> (H, W)`` (``dynamic``: Qwen2-VL ``smart_resize`` to multiples of
  patch*merge within [min_pixels, max_pixels]; ``fixed``: ``image_size`` square),
  ``patchify(rgb uint8 [H, W, 3]) -> (patches float32 [P, C*tp*p*p], grid (t, h, w))`` in
  Qwen2-VL's flattened layout (merge windows contiguous), and ``llm_tokens(h, w)``: the tokens the
  encoder hands the LLM after merging, from :func:`entrain_data.tokens.vision_tokens` (the cost
  model's own function), so placeholders, encoder output and cost agree.
- ``AudioTransform(cfg)``: log-mel features (``cfg.n_mels`` mels, ``cfg.audio_frame_rate`` frames
  per second at 16 kHz, Whisper's 25 ms Hann window and log10 scaling):
  ``frames(seconds)``, ``features(wave, seconds) -> float32 [F, n_mels]`` (cropped or padded to
  ``frames(seconds)``), ``llm_tokens(seconds)`` from :func:`entrain_data.tokens.audio_tokens`.
  ``ceil(frames / (conv_stride * pool)) == llm_tokens`` holds by construction.

The sizes used are the index's (metadata), never the decoded ones, so an LLM-only pack (a deferred
sample, not decoded) computes the same placeholder counts as the microbatch that encoded it.
"""

from __future__ import annotations

import math
from functools import cached_property, lru_cache

import numpy as np

from entrain_data.errors import InvalidInput
from entrain_data.presets import ModuleConfig
from entrain_data.tokens import audio_tokens, smart_resize, vision_tokens

__all__ = ["VisionTransform", "AudioTransform", "IMAGE_MEAN", "IMAGE_STD", "SAMPLE_RATE"]

IMAGE_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)  # CLIP / Qwen2-VL
IMAGE_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
SAMPLE_RATE = 16000
_EPS = 1e-9  # the same tolerance tokens.audio_tokens uses


class VisionTransform:
    """Resize + normalise + Qwen2-VL patch flattening for one vision encoder config."""

    def __init__(self, cfg: ModuleConfig) -> None:
        if cfg.kind != "vision":
            raise InvalidInput(f"module {cfg.name!r}: VisionTransform needs a vision module")
        if cfg.resize not in ("dynamic", "fixed"):
            raise InvalidInput(
                f"module {cfg.name!r}: the default vision transform supports resize 'dynamic' and "
                f"'fixed', not {cfg.resize!r}; pass a transform of your own"
            )
        self.cfg = cfg
        self.patch = cfg.patch_size
        self.merge = cfg.merge
        self.tp = cfg.temporal_patch
        self.channels = cfg.in_channels

    @property
    def patch_dim(self) -> int:
        return self.channels * self.tp * self.patch * self.patch

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) the image is resized to before patching."""
        c = self.cfg
        if c.resize == "fixed":
            return c.image_size, c.image_size
        h, w = smart_resize(
            np.array([height]),
            np.array([width]),
            c.patch_size * c.merge,
            c.min_pixels,
            c.max_pixels,
        )
        return int(h[0]), int(w[0])

    def llm_tokens(self, height: int, width: int, frames: int = 1) -> int:
        """Encoder output tokens (after merging) for an item of these sizes: the cost model's count."""
        t = vision_tokens(self.cfg, np.array([frames]), np.array([height]), np.array([width]))
        return int(t.llm_tokens[0])

    def grid(self, height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
        """Patch grid (t, h, w) of an item: what ``image_grid_thw`` holds."""
        H, W = self.target_size(height, width)
        return -(-frames // self.tp), H // self.patch, W // self.patch

    def patchify(self, rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Normalised patches [t*h*w, C*tp*p*p] (Qwen2-VL order) and the grid (t, h, w).

        A still image is repeated ``temporal_patch`` times, as the reference processor does.
        """
        H, W = rgb.shape[:2]
        p, m, tp = self.patch, self.merge, self.tp
        if H % (p * m) or W % (p * m):
            raise InvalidInput(f"image of {H}x{W} is not a multiple of patch*merge = {p * m}")
        gh, gw = H // p, W // p
        c = rgb.shape[2]
        # reorder the uint8 pixels first (a quarter of the bytes), then one fused normalise pass
        # [H, W, C] -> [gh/m, gw/m, m, m, C, p, p] (Qwen2-VL: merge windows contiguous)
        x8 = rgb.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
        xf = np.ascontiguousarray(x8).reshape(gh * gw, c, p * p).astype(np.float32)
        scale, offset = _norm_affine(c)
        xf *= scale
        xf += offset
        out = np.empty((gh * gw, c, tp, p * p), dtype=np.float32)
        out[...] = xf[:, :, None, :]  # a still image is repeated over the temporal patch
        return out.reshape(gh * gw, c * tp * p * p), (1, gh, gw)


@lru_cache(maxsize=4)
def _norm_affine(channels: int) -> tuple[np.ndarray, np.ndarray]:
    """(x / 255 - mean) / std as x * scale + offset, shaped [1, C, 1]."""
    mean, std = IMAGE_MEAN[:channels], IMAGE_STD[:channels]
    scale = (1.0 / 255.0 / std).astype(np.float32)[None, :, None]
    return scale, (-mean / std).astype(np.float32)[None, :, None]


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
    return weights.astype(np.float32)


class AudioTransform:
    """Log-mel features of one audio encoder config (16 kHz input)."""

    def __init__(self, cfg: ModuleConfig, sample_rate: int = SAMPLE_RATE) -> None:
        if cfg.kind != "audio":
            raise InvalidInput(f"module {cfg.name!r}: AudioTransform needs an audio module")
        self.cfg = cfg
        self.sample_rate = sample_rate
        self.hop = int(round(sample_rate / cfg.audio_frame_rate))
        # Whisper's 25 ms window; never shorter than the hop, so no sample is skipped at low rates
        self.n_fft = max(int(round(0.025 * sample_rate)), self.hop)
        self.n_mels = cfg.n_mels

    @cached_property
    def _filters(self) -> np.ndarray:
        return _mel_filters(self.n_mels, self.n_fft, self.sample_rate)

    @cached_property
    def _window(self) -> np.ndarray:
        return np.hanning(self.n_fft + 1)[:-1].astype(np.float32)

    def frames(self, seconds: float) -> int:
        """Mel frames of a clip: ceil(seconds * rate) (at least 1); divides into the LLM tokens."""
        k = self.cfg.audio_conv_stride * self.cfg.audio_pool
        return max(1, math.ceil(seconds * self.cfg.audio_frame_rate - k * _EPS))

    def llm_tokens(self, seconds: float) -> int:
        """Encoder output tokens of a clip: the cost model's count."""
        return int(audio_tokens(self.cfg, np.array([seconds])).llm_tokens[0])

    def features(self, wave: np.ndarray, seconds: float) -> np.ndarray:
        """float32 [frames(seconds), n_mels] log-mel frames (crop or zero-pad to the index length)."""
        n_frames = self.frames(seconds)
        x = np.asarray(wave, dtype=np.float32)
        pad = self.n_fft // 2
        if len(x) < 2:
            x = np.zeros(self.n_fft, dtype=np.float32)
        x = np.pad(x, pad, mode="reflect" if len(x) > pad else "constant")
        n = 1 + (len(x) - self.n_fft) // self.hop
        frames = np.lib.stride_tricks.sliding_window_view(x, self.n_fft)[:: self.hop][:n]
        spec = np.abs(np.fft.rfft(frames * self._window, axis=1)) ** 2
        mel = spec.astype(np.float32) @ self._filters.T
        logmel = np.log10(np.maximum(mel, 1e-10))
        logmel = np.maximum(logmel, logmel.max() - 8.0) if logmel.size else logmel
        logmel = (logmel + 4.0) / 4.0
        out = np.zeros((n_frames, self.n_mels), dtype=np.float32)
        k = min(n_frames, len(logmel))
        out[:k] = logmel[:k]
        return out
