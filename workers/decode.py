"""Decoding sample members: images (PIL), audio (soundfile), text and conversation JSON.

Public API (stable; used by the index builder and the packer):

- ``member_kind(ext) -> "image" | "audio" | "text" | None`` from a member's extension
  (``jpg``, ``0.png``, ``txt``, ``txt.gz``, ``json`` ...); a ``.gz`` suffix is decompressed.
- ``image_size(data) -> (height, width)``: from the header only (PIL opens lazily).
- ``decode_image(data, size=None) -> uint8 [H, W, 3]``: RGB, resized to ``size`` = (H, W); JPEGs
  that shrink use PIL's draft mode (DCT scaling), several times faster than a full decode.
- ``audio_seconds(data) -> float``: duration from the header (soundfile; ``wave`` as fallback).
- ``decode_audio(data, sample_rate=16000) -> float32 [n]``: mono, resampled (linear interpolation).
- ``text_segments(members) -> list[TextSegment]``: the sample's text as (text, loss) segments; a
  conversation JSON (LLaVA ``conversations``/``from``/``value``, OpenAI ``messages``/``role``/
  ``content``, or a list of turns) renders each turn as ``"role: text\\n"`` with the loss on the
  assistant turns; a ``txt`` member (or ``cls`` label, or JSON ``text``/``caption``) is one
  segment with loss.

Any failure raises ``ValueError`` with the reason; the caller wraps it into a SampleError that names
the shard and key (it knows them, this module does not).
"""

from __future__ import annotations

import gzip
import io
import json
import wave
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf
from PIL import Image, UnidentifiedImageError

__all__ = [
    "IMAGE_EXTS",
    "AUDIO_EXTS",
    "TEXT_EXTS",
    "TextSegment",
    "member_kind",
    "member_payload",
    "image_size",
    "decode_image",
    "audio_seconds",
    "decode_audio",
    "text_segments",
]

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")
AUDIO_EXTS = ("wav", "flac", "mp3", "ogg", "opus")
TEXT_EXTS = ("txt", "text", "caption", "json", "cls")
_ASSISTANT_ROLES = ("gpt", "assistant", "model", "bot")

Image.MAX_IMAGE_PIXELS = 1 << 28  # real document scans exceed PIL's default bomb guard


@dataclass(frozen=True)
class TextSegment:
    """A piece of the sample's text; ``loss``: whether the LLM is trained to predict it."""

    text: str
    loss: bool


def _base_ext(ext: str) -> str:
    e = ext.lower()
    if e.endswith(".gz"):
        e = e[:-3]
    return e.rsplit(".", 1)[-1]


def member_kind(ext: str) -> str | None:
    """The modality of a member from its extension (last component, ``.gz`` stripped)."""
    e = _base_ext(ext)
    if e in IMAGE_EXTS:
        return "image"
    if e in AUDIO_EXTS:
        return "audio"
    if e in TEXT_EXTS:
        return "text"
    return None


def member_payload(ext: str, data: bytes) -> bytes:
    """The member's bytes, gunzipped when its extension ends in ``.gz``."""
    if ext.lower().endswith(".gz"):
        try:
            return gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise ValueError(f"member .{ext} is not valid gzip ({exc})") from exc
    return data


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) from the image header, without decoding the pixels."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        raise ValueError(f"not a readable image ({exc})") from exc
    if w < 1 or h < 1:
        raise ValueError(f"image has an empty size {w}x{h}")
    return int(h), int(w)


def decode_image(data: bytes, size: tuple[int, int] | None = None) -> np.ndarray:
    """RGB uint8 [H, W, 3], resized (bicubic) to ``size`` = (H, W) when given."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if size is not None and im.format == "JPEG":
                # DCT-domain downscale to at least the target: big pages decode several times faster
                im.draft("RGB", (size[1], size[0]))
            im = im.convert("RGB")
            if size is not None and (im.height, im.width) != tuple(size):
                im = im.resize((int(size[1]), int(size[0])), Image.BICUBIC)
            arr = np.asarray(im, dtype=np.uint8)
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:
        raise ValueError(f"image does not decode ({exc})") from exc
    return arr


def audio_seconds(data: bytes) -> float:
    """Duration in seconds from the audio header (frames / sample rate)."""
    try:
        info = sf.info(io.BytesIO(data))
        frames, rate = int(info.frames), int(info.samplerate)
    except (RuntimeError, sf.LibsndfileError, TypeError) as exc:
        try:
            with wave.open(io.BytesIO(data)) as w:
                frames, rate = w.getnframes(), w.getframerate()
        except (wave.Error, EOFError, OSError) as exc2:
            raise ValueError(f"not a readable audio file ({exc}; {exc2})") from exc
    if rate <= 0 or frames < 0:
        raise ValueError(f"audio header has {frames} frames at {rate} Hz")
    return frames / rate


def decode_audio(data: bytes, sample_rate: int = 16000) -> np.ndarray:
    """Mono float32 waveform at ``sample_rate`` (channels averaged; linear-interpolation resample)."""
    try:
        wav, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, sf.LibsndfileError, TypeError) as exc:
        raise ValueError(f"audio does not decode ({exc})") from exc
    mono = wav.mean(axis=1) if wav.shape[1] > 1 else wav[:, 0]
    if rate != sample_rate and len(mono):
        n_out = max(1, int(round(len(mono) * sample_rate / rate)))
        t = np.arange(n_out, dtype=np.float64) * (rate / sample_rate)
        mono = np.interp(t, np.arange(len(mono)), mono).astype(np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32)


def _turn_text(turn: Any) -> tuple[str, str]:
    if isinstance(turn, str):
        return "", turn
    if not isinstance(turn, Mapping):
        raise ValueError(f"conversation turn is a {type(turn).__name__}, expected an object")
    role = str(turn.get("from", turn.get("role", "")))
    value = turn.get("value", turn.get("content", turn.get("text", "")))
    if isinstance(value, list):  # OpenAI multi-part content: keep the text parts
        value = "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in value)
    return role, str(value)


def _json_segments(obj: Any) -> list[TextSegment]:
    turns = None
    if isinstance(obj, list):
        turns = obj
    elif isinstance(obj, Mapping):
        for k in ("conversations", "messages", "conversation", "turns"):
            if isinstance(obj.get(k), list):
                turns = obj[k]
                break
        if turns is None:
            for k in ("text", "caption", "content", "value"):
                if isinstance(obj.get(k), str):
                    return [TextSegment(obj[k], True)]
            return []
    else:
        return [TextSegment(str(obj), True)]
    segs: list[TextSegment] = []
    roles = [_turn_text(t)[0] for t in turns]
    has_assistant = any(r.lower() in _ASSISTANT_ROLES for r in roles)
    for turn in turns:
        role, text = _turn_text(turn)
        loss = role.lower() in _ASSISTANT_ROLES if has_assistant else True
        segs.append(TextSegment(f"{role}: {text}\n" if role else f"{text}\n", loss))
    return segs


def text_segments(members: Mapping[str, bytes]) -> list[TextSegment]:
    """The text of a sample from its text members (``json`` first, then ``txt``-like), in order.

    Raises ValueError when no text member exists or one does not parse.
    """
    texts = sorted(e for e in members if member_kind(e) == "text")
    if not texts:
        raise ValueError("sample has no text member (txt/json)")
    segs: list[TextSegment] = []
    for ext in sorted(texts, key=lambda e: (_base_ext(e) != "json", e)):
        raw = member_payload(ext, members[ext])
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"text member .{ext} is not UTF-8 ({exc})") from exc
        if _base_ext(ext) == "json":
            try:
                segs.extend(_json_segments(json.loads(s)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"text member .{ext} is not valid JSON ({exc})") from exc
        else:
            segs.append(TextSegment(s, True))
    return segs
