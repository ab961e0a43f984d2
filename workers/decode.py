"""Decoding sample members: images (PIL), audio (soundfile), video (PyAV), text and conversation JSON.

Public API (stable; used by the index builder and the packer):

- ``member_kind(ext) -> "image" | "audio" | "video" | "text" | None`` from a member's extension
  (``jpg``, ``0.png``, ``mp4``, ``txt``, ``txt.gz``, ``json`` ...); a ``.gz`` suffix is decompressed.
- ``image_size(data) -> (height, width)``: from the header only (PIL opens lazily), as displayed
  (the EXIF orientation in the header applied, as ``transformers``' ``load_image`` does).
- ``decode_image(data, size=None, draft=False) -> uint8 [H, W, 3]``: RGB (transparency composited
  onto white, as the ``transformers`` processors do), resized with PIL's bicubic filter to
  ``size`` = (H, W). ``draft=True`` lets JPEGs that shrink decode in PIL's draft mode (DCT
  scaling): several times faster on big pages, but the pixels then differ from the published
  processors', so it is off by default.
- ``probe_video(data) -> VideoInfo``: duration, fps, frame count, height, width from the container
  header (PyAV; no frame is decoded). ``sampled_frames(seconds)``: the cost model's video rule
  (``VIDEO_FPS`` frames per second, clipped to [``VIDEO_MIN_FRAMES``, ``VIDEO_MAX_FRAMES``]).
- ``decode_video(data, frames, size=None) -> list[uint8 [H, W, 3]]``: ``frames`` frames sampled
  uniformly as Qwen2-VL's video processor samples them (``arange(0, total, total / frames)``),
  each resized (bicubic) to ``size``.
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
import math
import wave
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf
from PIL import Image, UnidentifiedImageError

from entrain_data.workloads import VIDEO_FPS, VIDEO_MAX_FRAMES, VIDEO_MIN_FRAMES

__all__ = [
    "IMAGE_EXTS",
    "AUDIO_EXTS",
    "VIDEO_EXTS",
    "VideoInfo",
    "probe_video",
    "sampled_frames",
    "decode_video",
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
VIDEO_EXTS = ("mp4", "avi", "mkv", "webm", "mov", "m4v", "mpeg", "mpg")
TEXT_EXTS = ("txt", "text", "caption", "json", "cls")
_CAPTION_EXTS = ("txt", "text", "caption")  # beside them a metadata .json is not text (a .cls is)
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
    if e in VIDEO_EXTS:
        return "video"
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


_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that turn the stored image by 90 degrees
_TURNS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _orientation(im: Image.Image) -> int:
    """The EXIF orientation tag (1 where there is none or it does not parse), from the EXIF
    block the header holds (JPEG APP1, a PNG eXIf chunk before the pixels, WebP): never
    ``im.getexif()``, which decodes a whole PNG to look for a block after its pixels."""
    raw = im.info.get("exif")
    if not raw:
        return 1
    try:
        exif = Image.Exif()
        exif.load(raw)
        return int(exif.get(0x0112, 1))
    except Exception:  # a truncated or malformed EXIF block: the image as stored
        return 1


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) as displayed, from the image header, without decoding the pixels: a
    phone photo stored landscape with an EXIF rotation is portrait, as ``transformers``'
    ``load_image`` (``ImageOps.exif_transpose``) and :func:`decode_image` give it."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if _orientation(im) in _TRANSPOSED:
                w, h = h, w
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:  # PIL names the file as <_io.BytesIO object at 0x...>: the caller names it
        why = "not a known image format" if isinstance(exc, UnidentifiedImageError) else exc
        raise ValueError(f"not a readable image ({why})") from exc
    if w < 1 or h < 1:
        raise ValueError(f"image has an empty size {w}x{h}")
    return int(h), int(w)


def _to_rgb(im: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (``transformers.image_transforms.convert_to_rgb``)."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")  # convert would copy an RGB image


def decode_image(
    data: bytes, size: tuple[int, int] | None = None, draft: bool = False
) -> np.ndarray:
    """RGB uint8 [H, W, 3] as displayed (EXIF orientation applied), resized (bicubic) to
    ``size`` = (H, W) when given."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            turn = _orientation(im)
            if draft and size is not None and im.format == "JPEG":
                # DCT-domain downscale to at least the target: big pages decode several times faster
                im.draft("RGB", tuple(size) if turn in _TRANSPOSED else (size[1], size[0]))
            if turn in _TURNS:  # as ImageOps.exif_transpose, from the same block as the index
                im = im.transpose(_TURNS[turn])
            im = _to_rgb(im)
            if size is not None and (im.height, im.width) != tuple(size):
                im = im.resize((int(size[1]), int(size[0])), Image.BICUBIC)
            arr = np.asarray(im, dtype=np.uint8)
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as exc:  # not PIL's <_io.BytesIO object at 0x...>: the caller names the sample
        why = "not a known image format" if isinstance(exc, UnidentifiedImageError) else exc
        raise ValueError(f"image does not decode ({why})") from exc
    return arr


@dataclass(frozen=True)
class VideoInfo:
    """What a container header says about its first video stream."""

    seconds: float
    fps: float
    frames: int  # 0 when the header does not count them
    height: int
    width: int


def _av() -> Any:
    """PyAV, imported on the first video member (the ``video`` extra)."""
    try:
        import av
    except ImportError as exc:
        raise ValueError(
            "video members need PyAV: pip install 'entrain-data[video]' (or av)"
        ) from exc
    return av


def _open_video(data: bytes) -> Any:
    av = _av()
    try:
        return av.open(io.BytesIO(data))
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise ValueError(f"not a readable video container ({exc})") from exc


def probe_video(data: bytes) -> VideoInfo:
    """Duration, fps, frame count and size from the container header (no frame decoded)."""
    with _open_video(data) as c:
        if not c.streams.video:
            raise ValueError("video container has no video stream")
        s = c.streams.video[0]
        fps = float(s.average_rate or s.guessed_rate or 0.0)
        if s.duration is not None and s.time_base is not None:
            seconds = float(s.duration * s.time_base)
        elif c.duration is not None:
            seconds = c.duration / 1_000_000
        else:
            seconds = s.frames / fps if s.frames and fps else 0.0
        h, w = int(s.codec_context.height), int(s.codec_context.width)
        n = int(s.frames or 0)
    if seconds <= 0 or h < 1 or w < 1:
        raise ValueError(f"video header gives {seconds:.3f} s of {w}x{h} pixels")
    return VideoInfo(seconds, fps, n, h, w)


def sampled_frames(seconds: float) -> int:
    """Frames a clip contributes: the cost model's rule (workloads.VIDEO_FPS, MIN/MAX frames)."""
    return int(min(max(round(seconds * VIDEO_FPS), VIDEO_MIN_FRAMES), VIDEO_MAX_FRAMES))


def _picks(total: int, frames: int) -> list[int]:
    step = total / frames  # Qwen2-VL's video processor: arange(0, total, total / frames).int()
    return [min(int(math.floor(i * step)), total - 1) for i in range(frames)]


def _decode_picks(data: bytes, picks: list[int]) -> tuple[dict[int, Image.Image], int]:
    """The picked frames as RGB images (only those are converted) and the frames decoded."""
    av = _av()

    wanted, got, total = set(picks), {}, 0
    with _open_video(data) as c:
        if not c.streams.video:
            raise ValueError("video container has no video stream")
        try:
            for i, f in enumerate(c.decode(video=0)):
                if i in wanted:
                    got[i] = f.to_image()
                total = i + 1
        except (av.FFmpegError, ValueError) as exc:
            raise ValueError(f"video does not decode ({exc})") from exc
    return got, total


def decode_video(data: bytes, frames: int, size: tuple[int, int] | None = None) -> list[np.ndarray]:
    """``frames`` RGB frames sampled uniformly over the clip, resized (bicubic) to ``size``.

    The frame count of the header picks the frames in one decoding pass; when the stream decodes
    to another count (headers may not count, or miscount), a second pass uses the real one.
    """
    header = probe_video(data).frames
    picks = _picks(header, frames) if header else []
    got, total = _decode_picks(data, picks)
    if total == 0:
        raise ValueError("video has no decodable frame")
    if total != header:
        picks = _picks(total, frames)
        got, total = _decode_picks(data, picks)
    out = []
    for i in picks:
        im = got[i].convert("RGB")
        if size is not None and (im.height, im.width) != tuple(size):
            im = im.resize((int(size[1]), int(size[0])), Image.BICUBIC)
        out.append(np.asarray(im, dtype=np.uint8))
    return out


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
            why = getattr(exc, "error_string", exc)  # not "Error opening <_io.BytesIO ...>"
            raise ValueError(f"not a readable audio file ({why}; {exc2})") from exc
    if rate <= 0 or frames < 0:
        raise ValueError(f"audio header has {frames} frames at {rate} Hz")
    return frames / rate


def decode_audio(data: bytes, sample_rate: int = 16000) -> np.ndarray:
    """Mono float32 waveform at ``sample_rate`` (channels averaged; linear-interpolation resample)."""
    try:
        wav, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, sf.LibsndfileError, TypeError) as exc:
        why = getattr(exc, "error_string", exc)  # not "Error opening <_io.BytesIO ...>"
        raise ValueError(f"audio does not decode ({why})") from exc
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


_TURN_KEYS = ("conversations", "messages", "conversation", "turns")


def _is_conversation(obj: Any) -> bool:
    """A list of turns, or an object holding one under a conversation key."""
    return isinstance(obj, list) or (
        isinstance(obj, Mapping) and any(isinstance(obj.get(k), list) for k in _TURN_KEYS)
    )


def _json_segments(obj: Any) -> list[TextSegment]:
    turns = None
    if isinstance(obj, list):
        turns = obj
    elif isinstance(obj, Mapping):
        for k in _TURN_KEYS:
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

    Beside a ``txt``-like member, a ``json`` member counts only where it holds a conversation:
    img2dataset / LAION / DataComp shards pair the caption (``.txt``) with a metadata object
    (``.json``: url, sizes and the caption again), which is not more text to train on.
    Raises ValueError when no text member exists or one does not parse.
    """
    texts = sorted(e for e in members if member_kind(e) == "text")
    if not texts:
        raise ValueError("sample has no text member (txt/json)")
    has_txt = any(_base_ext(e) in _CAPTION_EXTS for e in texts)
    segs: list[TextSegment] = []
    for ext in sorted(texts, key=lambda e: (_base_ext(e) != "json", e)):
        raw = member_payload(ext, members[ext])
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"text member .{ext} is not UTF-8 ({exc})") from exc
        if _base_ext(ext) == "json":
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as exc:
                raise ValueError(f"text member .{ext} is not valid JSON ({exc})") from exc
            if not has_txt or _is_conversation(obj):
                segs.extend(_json_segments(obj))
        else:
            segs.append(TextSegment(s, True))
    return segs
