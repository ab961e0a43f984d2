"""Named synthetic workloads that reproduce published MLLM training distributions.

Every generator samples per-sample sizes from the empirical quantile
functions in :mod:`entrain_data.workload_tables` (derived from the real tables
in ``../shared/data/metadata``; sources cited there), so the spread of image
sizes, clip durations and text lengths is that of the real corpora. Where a
workload mixes corpora, the mixture weights are ours and stated in the
generator's docstring. Deterministic for a seed.

Text tokens are estimated from characters: :data:`CHARS_PER_TOKEN` (about 4
characters of English per BPE token for the Llama 3 / Qwen2 tokenizers) plus
:data:`TEMPLATE_TOKENS_PER_TURN` chat-template tokens (role markers) per
question/answer round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import workload_tables as T
from .errors import InvalidInput
from .metadata import SampleTable

__all__ = [
    "CHARS_PER_TOKEN",
    "TEMPLATE_TOKENS_PER_TURN",
    "VIDEO_FPS",
    "VIDEO_MAX_FRAMES",
    "list_workloads",
    "synthesize",
    "describe_workload",
]

CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS_PER_TURN = 10
VIDEO_FPS = 1.0  # frames sampled per second of video
VIDEO_MAX_FRAMES = 64  # cap on sampled frames per clip
VIDEO_MIN_FRAMES = 4


@dataclass
class _Part:
    """Columns of one mixture component: per sample text and item counts, per item sizes."""

    text: np.ndarray
    img_counts: np.ndarray
    frames: np.ndarray
    height: np.ndarray
    width: np.ndarray
    aud_counts: np.ndarray
    seconds: np.ndarray

    @classmethod
    def build(cls, text, images=None, audio=None, n: int | None = None) -> _Part:
        """``images``: (counts, frames, height, width) or None; ``audio``: (counts, seconds) or None."""
        n = len(text) if n is None else n
        z = np.zeros(0, dtype=np.int32)
        ic, fr, h, w = images if images is not None else (np.zeros(n, np.int64), z, z, z)
        ac, sec = audio if audio is not None else (np.zeros(n, np.int64), np.zeros(0, np.float32))
        return cls(
            text=np.asarray(text, dtype=np.int64),
            img_counts=np.asarray(ic, dtype=np.int64),
            frames=np.asarray(fr, dtype=np.int32),
            height=np.asarray(h, dtype=np.int32),
            width=np.asarray(w, dtype=np.int32),
            aud_counts=np.asarray(ac, dtype=np.int64),
            seconds=np.asarray(sec, dtype=np.float32),
        )


def _q(rng: np.random.Generator, table: tuple, n: int) -> np.ndarray:
    """Inverse-CDF sample of a quantile table (piecewise-linear between the quantiles)."""
    return np.interp(rng.random(n), T.QUANTILE_PROBS, np.asarray(table, dtype=np.float64))


def _cat(rng: np.random.Generator, counts: dict, n: int) -> np.ndarray:
    """``n`` draws of the keys of ``counts`` with probability proportional to the counts.

    Returns an array of keys; tuple keys (e.g. (width, height)) give an [n, 2] array.
    """
    keys = list(counts)
    p = np.array([counts[k] for k in keys], dtype=np.float64)
    idx = rng.choice(len(keys), size=n, p=p / p.sum())
    table = np.array(keys) if not isinstance(keys[0], str) else np.array(keys, dtype=object)
    return table[idx]


def _tokens(chars: np.ndarray, turns: np.ndarray | int = 1) -> np.ndarray:
    return np.ceil(np.asarray(chars, dtype=np.float64) / CHARS_PER_TOKEN).astype(
        np.int64
    ) + TEMPLATE_TOKENS_PER_TURN * np.asarray(turns)


def _coco_sizes(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) of COCO photos: long side, short/long ratio and orientation sampled from COCO val2017."""
    long = _q(rng, T.COCO_LONG_SIDE, n)
    short = np.maximum(1.0, np.round(long * _q(rng, T.COCO_SHORT_OVER_LONG, n)))
    portrait = rng.random(n) < T.COCO_PORTRAIT_FRACTION
    long = np.round(long)
    return np.where(portrait, long, short), np.where(portrait, short, long)


def _llava_chat(rng: np.random.Generator, n: int) -> np.ndarray:
    """Text tokens of LLaVA-Instruct-150K records (conversation / detail / complex reasoning mix)."""
    kind = _cat(rng, T.LLAVA_KIND_COUNTS, n)
    chars = np.empty(n)
    turns = np.ones(n, dtype=np.int64)
    for k, table in (
        ("conv", T.LLAVA_CONV_CHARS),
        ("detail", T.LLAVA_DETAIL_CHARS),
        ("complex", T.LLAVA_COMPLEX_CHARS),
    ):
        m = kind == k
        chars[m] = _q(rng, table, int(m.sum()))
    m = kind == "conv"
    turns[m] = _cat(rng, T.LLAVA_CONV_TURN_COUNTS, int(m.sum()))
    return _tokens(chars, turns)


def _images(counts: np.ndarray, h: np.ndarray, w: np.ndarray, frames: np.ndarray | None = None):
    fr = np.ones(len(h), dtype=np.int64) if frames is None else frames
    return counts, fr, h, w


# ------------------------------------------------------------------ components
def _c_coco_chat(rng, n):
    h, w = _coco_sizes(rng, n)
    return _Part.build(_llava_chat(rng, n), _images(np.ones(n), h, w))


def _c_multi_image(rng, n, lo=2, hi=8):
    counts = rng.integers(lo, hi + 1, n)
    h, w = _coco_sizes(rng, int(counts.sum()))
    return _Part.build(_llava_chat(rng, n), _images(counts, h, w))


def _c_documents(rng, n):
    page = rng.random(n) < T.SROIE_PAGE_FRACTION
    w = np.where(page, _q(rng, T.SROIE_PAGE_WIDTH, n), _q(rng, T.SROIE_RECEIPT_WIDTH, n))
    ratio = np.where(page, _q(rng, T.SROIE_PAGE_H_OVER_W, n), _q(rng, T.SROIE_RECEIPT_H_OVER_W, n))
    h = np.round(w * ratio)
    # a transcription / key-information question: the answer carries the page's OCR text
    text = _tokens(_q(rng, T.SROIE_OCR_CHARS, n)) + 20
    return _Part.build(text, _images(np.ones(n), h, np.round(w)))


def _c_long_caption(rng, n):
    # ImageInWords descriptions of high-resolution photos; the IIW release has no image sizes,
    # so we assume camera photos: long side log-uniform in [1024, 4032] px, 4:3 or 3:4.
    long = np.round(np.exp(rng.uniform(np.log(1024), np.log(4032), n)))
    short = np.round(long * 0.75)
    portrait = rng.random(n) < 0.5
    text = _tokens(_q(rng, T.IIW_HUMAN_CHARS, n)) + 15
    return _Part.build(
        text, _images(np.ones(n), np.where(portrait, long, short), np.where(portrait, short, long))
    )


def _frames_for(seconds: np.ndarray) -> np.ndarray:
    f = np.clip(np.round(seconds * VIDEO_FPS), VIDEO_MIN_FRAMES, VIDEO_MAX_FRAMES)
    return (2 * np.ceil(f / 2)).astype(np.int64)  # even: temporal patches of 2


def _nextqa_sizes(rng, n):
    wh = _cat(rng, T.NEXTQA_FRAME_SIZES, n).reshape(n, 2)  # (width, height) keys
    return wh[:, 1], wh[:, 0]


def _c_video(rng, n, seconds_table, text_table):
    secs = _q(rng, seconds_table, n)
    h, w = _nextqa_sizes(rng, n)  # ActivityNet/Charades carry no resolution: NExT-QA's sizes
    text = _tokens(_q(rng, text_table, n)) + 20
    return _Part.build(text, _images(np.ones(n), h, w, _frames_for(secs)))


def _c_nextqa(rng, n):
    secs = _q(rng, T.NEXTQA_FRAMES_30FPS, n) / 30.0
    h, w = _nextqa_sizes(rng, n)
    return _Part.build(
        _tokens(_q(rng, T.NEXTQA_QA_CHARS, n)), _images(np.ones(n), h, w, _frames_for(secs))
    )


def _c_librispeech(rng, n):
    secs = _q(rng, T.LIBRISPEECH_SECONDS, n)
    chars = secs * _q(rng, T.LIBRISPEECH_CHARS_PER_SECOND, n)
    return _Part.build(_tokens(chars) + 10, audio=(np.ones(n), secs))


def _c_common_voice(rng, n):
    secs = _q(rng, T.COMMON_VOICE_ID_SECONDS, n)
    return _Part.build(_tokens(_q(rng, T.COMMON_VOICE_ID_CHARS, n)) + 10, audio=(np.ones(n), secs))


def _c_spoken_question(rng, n):
    h, w = _coco_sizes(rng, n)
    text = _tokens(_q(rng, T.LLAVA_COMPLEX_CHARS, n))
    secs = _q(rng, T.COMMON_VOICE_ID_SECONDS, n)
    return _Part.build(text, _images(np.ones(n), h, w), audio=(np.ones(n), secs))


def _c_text_sessions(rng, n, mean_sessions=6.0, cap=32):
    # a long text-only chat: K LLaVA-Instruct conversation records back to back,
    # K ~ 1 + Geometric (mean ``mean_sessions``, capped): an assumed session length
    k = np.minimum(rng.geometric(1.0 / mean_sessions, n), cap)
    total = int(k.sum())
    per = _q(rng, T.LLAVA_CONV_CHARS, total)
    turns = _cat(rng, T.LLAVA_CONV_TURN_COUNTS, total)
    owner = np.repeat(np.arange(n), k)
    chars = np.bincount(owner, weights=per, minlength=n)
    t = np.bincount(owner, weights=turns.astype(np.float64), minlength=n).astype(np.int64)
    return _Part.build(_tokens(chars, t))


# ------------------------------------------------------------------ workloads
def _llava_fixed() -> list[tuple[float, Callable]]:
    """LLaVA-1.5 style: one COCO photo per sample, LLaVA-Instruct-150K conversation lengths.

    Kind mix (conv / detail / complex), per-kind character quantiles and turn
    counts from LLaVA-Instruct-150K; image sizes from COCO val2017 (the
    instruct images are COCO train2017 photos, same collection).
    """
    return [(1.0, _c_coco_chat)]


def _qwen2vl_dynamic() -> list[tuple[float, Callable]]:
    """Dynamic resolution as in Qwen2-VL SFT mixes: photos, documents at full resolution, long captions.

    50% COCO photos with LLaVA-Instruct chats, 20% documents (SROIE sizes: 13%
    are 600 dpi A4 scans up to 4961x7016, the rest receipt photos; answers
    carry the OCR text), 15% ImageInWords long descriptions of high-resolution
    photos, 15% multi-image (2-8 COCO photos). Weights are ours.
    """
    return [
        (0.50, _c_coco_chat),
        (0.20, _c_documents),
        (0.15, _c_long_caption),
        (0.15, _c_multi_image),
    ]


def _multi_image_video() -> list[tuple[float, Callable]]:
    """Multi-image and video: ActivityNet Captions, Charades, NExT-QA clips and multi-image chats.

    30% ActivityNet (durations 2 s - 12 min, dense-caption text), 25% Charades
    (~30 s indoor clips, descriptions), 20% NExT-QA (frame counts at 30 fps,
    its resolutions, QA text), 25% 2-8 COCO photos with LLaVA chats. Frames
    sampled at :data:`VIDEO_FPS`, at most :data:`VIDEO_MAX_FRAMES`; ActivityNet
    and Charades take NExT-QA's resolutions. Weights are ours.
    """
    return [
        (0.30, lambda r, m: _c_video(r, m, T.ACTIVITYNET_SECONDS, T.ACTIVITYNET_CAPTION_CHARS)),
        (0.25, lambda r, m: _c_video(r, m, T.CHARADES_SECONDS, T.CHARADES_TEXT_CHARS)),
        (0.20, _c_nextqa),
        (0.25, _c_multi_image),
    ]


def _vision_audio() -> list[tuple[float, Callable]]:
    """Vision + speech: image chats, ASR on LibriSpeech and Common Voice, spoken questions on images.

    40% COCO + LLaVA-Instruct chats, 25% LibriSpeech dev-clean utterances
    (durations and transcript rate), 20% Common Voice (Indonesian) clips and
    sentences, 15% a COCO photo with a Common Voice-length spoken question and
    a LLaVA complex-reasoning answer. Weights are ours.
    """
    return [
        (0.40, _c_coco_chat),
        (0.25, _c_librispeech),
        (0.20, _c_common_voice),
        (0.15, _c_spoken_question),
    ]


def _text_heavy() -> list[tuple[float, Callable]]:
    """Text-heavy: mostly long text-only chats, some long-caption and document samples.

    70% text-only sessions of several LLaVA-Instruct conversations (session
    count ~ 1 + geometric, mean 6, our assumption), 15% ImageInWords long
    descriptions, 15% SROIE documents. Weights are ours.
    """
    return [(0.70, _c_text_sessions), (0.15, _c_long_caption), (0.15, _c_documents)]


_WORKLOADS: dict[str, Callable] = {
    "llava-fixed": _llava_fixed,
    "qwen2vl-dynamic": _qwen2vl_dynamic,
    "multi-image-video": _multi_image_video,
    "vision-audio": _vision_audio,
    "text-heavy": _text_heavy,
}


def list_workloads() -> list[str]:
    """Names accepted by :func:`synthesize`."""
    return list(_WORKLOADS)


def describe_workload(name: str) -> str:
    """First line of the workload's docstring (what it reproduces)."""
    if name not in _WORKLOADS:
        raise InvalidInput(f"unknown workload {name!r} (known: {', '.join(_WORKLOADS)})")
    return (_WORKLOADS[name].__doc__ or "").strip().splitlines()[0]


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _table(part: _Part, keys: np.ndarray, source: str) -> SampleTable:
    n = len(keys)
    return SampleTable(
        keys=keys,
        sources=np.full(n, source, dtype=object),
        members=keys.copy(),
        rows=np.full(n, -1, dtype=np.int64),
        text_tokens=part.text,
        image_offsets=_offsets(part.img_counts),
        image_frames=np.maximum(part.frames, 1).astype(np.int32),
        image_height=np.maximum(part.height, 1).astype(np.int32),
        image_width=np.maximum(part.width, 1).astype(np.int32),
        audio_offsets=_offsets(part.aud_counts),
        audio_seconds=np.maximum(part.seconds, 0.0).astype(np.float32),
        origin=source,
    )


def synthesize(name: str, samples: int, seed: int = 0) -> SampleTable:
    """``samples`` samples of workload ``name``, deterministic for ``seed``.

    Keys are ``<name>/<seed>/<i>``; ``source`` is ``synthetic:<name>`` (no
    payload exists: the table is for profiling, planning and benchmarks).
    """
    if name not in _WORKLOADS:
        raise InvalidInput(f"unknown workload {name!r} (known: {', '.join(_WORKLOADS)})")
    if not isinstance(samples, (int, np.integer)) or samples < 0:
        raise InvalidInput(f"synthesize: samples must be an integer >= 0, got {samples!r}")
    rng = np.random.default_rng([int(seed), list(_WORKLOADS).index(name)])
    comps = _WORKLOADS[name]()
    weights = np.array([w for w, _ in comps])
    which = rng.choice(len(comps), size=samples, p=weights / weights.sum())
    source = f"synthetic:{name}"
    tables, positions = [], []
    for c, (_, fn) in enumerate(comps):
        pos = np.flatnonzero(which == c)
        if len(pos) == 0:
            continue
        keys = np.array([f"{name}/{seed}/{i}" for i in pos], dtype=object)
        tables.append(_table(fn(rng, len(pos)), keys, source))
        positions.append(pos)
    if not tables:
        return _table(_Part.build(np.zeros(0)), np.zeros(0, dtype=object), source)
    merged = SampleTable.concat(tables)
    order = np.argsort(np.concatenate(positions), kind="stable")
    return merged.take(order)
