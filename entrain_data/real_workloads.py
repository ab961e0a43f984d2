"""Sample tables built directly from the real per-sample metadata CSVs (``shared/data/metadata``).

Benchmarks run on these to see real distributions rather than our synthetic
mixtures. Each builder reads one file (see the folder's PROVENANCE.md) and
keeps one sample per row; text tokens are estimated from characters as in
:mod:`entrain_data.workloads` (``CHARS_PER_TOKEN`` plus template tokens).
Where a file lacks a size the model needs, the substitute is stated in the
builder's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from .errors import InvalidInput
from .metadata import SampleTable
from .workloads import (
    CHARS_PER_TOKEN,
    TEMPLATE_TOKENS_PER_TURN,
    VIDEO_FPS,
    VIDEO_MAX_FRAMES,
    VIDEO_MIN_FRAMES,
)

__all__ = ["list_real_workloads", "real_workload"]


def _read(path: Path, columns: list[str]) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise InvalidInput(f"real workload: file not found: {path}")
    try:
        ids = {c: pa.string() for c in columns if c.endswith("_id") or c == "ann_set"}
        opts = pacsv.ConvertOptions(include_columns=columns, column_types=ids)
        t = pacsv.read_csv(path, convert_options=opts)
    except (pa.ArrowInvalid, KeyError) as exc:
        raise InvalidInput(f"{path}: cannot read columns {columns} ({exc})") from exc
    return {c: t.column(c).to_numpy(zero_copy_only=False) for c in columns}


def _tok(chars, turns=1) -> np.ndarray:
    c = np.nan_to_num(np.asarray(chars, dtype=np.float64))
    return np.ceil(c / CHARS_PER_TOKEN).astype(np.int64) + TEMPLATE_TOKENS_PER_TURN * np.asarray(
        turns, dtype=np.int64
    )


def _frames(seconds: np.ndarray) -> np.ndarray:
    f = np.clip(
        np.round(np.asarray(seconds, dtype=np.float64) * VIDEO_FPS),
        VIDEO_MIN_FRAMES,
        VIDEO_MAX_FRAMES,
    )
    return (2 * np.ceil(f / 2)).astype(np.int32)


def _build(
    path: Path,
    keys: list[str] | np.ndarray,
    text: np.ndarray,
    images: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    seconds: np.ndarray | None = None,
) -> SampleTable:
    """One item per sample (an image/clip when ``images`` is given, an audio clip when ``seconds`` is)."""
    n = len(keys)
    one = np.arange(n + 1, dtype=np.int64)
    none = np.zeros(n + 1, dtype=np.int64)
    fr, h, w = images if images is not None else (np.zeros(0),) * 3
    return SampleTable(
        keys=np.asarray(keys, dtype=object),
        sources=np.full(n, str(path), dtype=object),
        members=np.full(n, "", dtype=object),
        rows=np.arange(n, dtype=np.int64),
        text_tokens=np.asarray(text, dtype=np.int64),
        image_offsets=one if images is not None else none,
        image_frames=np.asarray(fr, dtype=np.int32),
        image_height=np.asarray(h, dtype=np.int32),
        image_width=np.asarray(w, dtype=np.int32),
        audio_offsets=one if seconds is not None else none,
        audio_seconds=np.asarray(seconds if seconds is not None else np.zeros(0), dtype=np.float32),
        origin=str(path),
    )


def _coco_captions(d: Path) -> SampleTable:
    """COCO val2017: one sample per image with its longest caption, at the annotated image size."""
    p = d / "coco_val2017" / "coco_val2017_images.csv"
    c = _read(p, ["image_id", "width", "height", "cap_chars_max"])
    keys = [f"coco/{i}" for i in c["image_id"]]
    return _build(p, keys, _tok(c["cap_chars_max"]), (np.ones(len(keys)), c["height"], c["width"]))


def _llava_instruct(d: Path) -> SampleTable:
    """LLaVA-Instruct-150K records (human + gpt characters, rounds).

    The COCO train2017 sizes are not in the shared data; each record takes the
    size of the COCO val2017 image at position ``coco_id mod 5000`` (a real size
    of the same collection, fixed per image id).
    """
    p = d / "llava_instruct" / "llava_instruct_150k_lengths.csv"
    c = _read(p, ["coco_id", "n_turns", "human_chars", "gpt_chars"])
    s = _read(d / "coco_val2017" / "coco_val2017_images.csv", ["width", "height"])
    pick = c["coco_id"].astype(np.int64) % len(s["width"])
    keys = [f"llava/{i}" for i in range(len(pick))]
    text = _tok(c["human_chars"].astype(np.float64) + c["gpt_chars"], c["n_turns"])
    return _build(p, keys, text, (np.ones(len(keys)), s["height"][pick], s["width"][pick]))


def _sroie(d: Path) -> SampleTable:
    """SROIE receipts and page scans at their JPEG sizes; the answer carries the OCR text."""
    p = d / "docs_sroie" / "sroie_trainval_receipts.csv"
    c = _read(p, ["image_id", "width", "height", "ocr_chars"])
    keys = [f"sroie/{i}" for i in range(len(c["width"]))]
    return _build(p, keys, _tok(c["ocr_chars"]) + 20, (np.ones(len(keys)), c["height"], c["width"]))


def _librispeech(d: Path) -> SampleTable:
    """LibriSpeech dev-clean utterances: duration and transcript (ASR)."""
    p = d / "librispeech_dev_clean" / "librispeech_dev_clean.csv"
    c = _read(p, ["utt_id", "duration_s", "transcript_chars"])
    return _build(
        p,
        [f"librispeech/{u}" for u in c["utt_id"]],
        _tok(c["transcript_chars"]) + 10,
        seconds=c["duration_s"],
    )


def _common_voice(locale: str) -> Callable[[Path], SampleTable]:
    def build(d: Path) -> SampleTable:
        p = d / "common_voice" / f"common_voice_{locale}.csv"
        c = _read(p, ["clip_id", "duration_s", "sentence_chars"])
        keep = ~np.isnan(c["sentence_chars"].astype(np.float64))
        keys = [f"cv-{locale}/{i}" for i in c["clip_id"][keep]]
        return _build(p, keys, _tok(c["sentence_chars"][keep]) + 10, seconds=c["duration_s"][keep])

    build.__doc__ = (
        f"Common Voice ({locale}) clips whose sentence is known: duration and sentence length."
    )
    return build


def _activitynet(d: Path) -> SampleTable:
    """ActivityNet Captions val (both annotation sets): whole video, all segment captions.

    The release has no resolution: frames are taken as 640x360 (YouTube 360p).
    """
    p = d / "video" / "activitynet_captions_val.csv"
    c = _read(p, ["video_id", "ann_set", "duration_s", "sent_chars_total"])
    keys = [f"anet/{v}/{a}" for v, a in zip(c["video_id"], c["ann_set"])]
    n = len(keys)
    return _build(
        p,
        keys,
        _tok(c["sent_chars_total"]) + 20,
        (_frames(c["duration_s"]), np.full(n, 360), np.full(n, 640)),
    )


def _charades(d: Path) -> SampleTable:
    """Charades v1 videos with their descriptions; no resolution in the metadata: 640x480 assumed."""
    p = d / "video" / "charades_v1.csv"
    c = _read(p, ["video_id", "length_s", "descriptions_chars", "script_chars"])
    desc = np.nan_to_num(c["descriptions_chars"].astype(np.float64))
    chars = np.where(desc > 0, desc, np.nan_to_num(c["script_chars"].astype(np.float64)))
    # 1,636 recovered test rows have no video id (PROVENANCE): key those by their CSV row
    keys = [f"charades/{v}" if v else f"charades/row{i}" for i, v in enumerate(c["video_id"])]
    n = len(keys)
    return _build(
        p, keys, _tok(chars) + 20, (_frames(c["length_s"]), np.full(n, 480), np.full(n, 640))
    )


def _nextqa(d: Path) -> SampleTable:
    """NExT-QA val/test videos at their sizes (frame_count at 30 fps); one question with its options."""
    p = d / "video" / "nextqa_valtest.csv"
    c = _read(
        p,
        ["video_id", "frame_count", "width", "height", "question_chars_mean", "options_chars_mean"],
    )
    keys = [f"nextqa/{v}" for v in c["video_id"]]
    text = _tok(c["question_chars_mean"].astype(np.float64) + c["options_chars_mean"])
    return _build(p, keys, text, (_frames(c["frame_count"] / 30.0), c["height"], c["width"]))


_REAL: dict[str, Callable[[Path], SampleTable]] = {
    "coco-captions": _coco_captions,
    "llava-instruct": _llava_instruct,
    "sroie-docs": _sroie,
    "librispeech": _librispeech,
    "common-voice-id": _common_voice("id"),
    "common-voice-ps": _common_voice("ps"),
    "video-activitynet": _activitynet,
    "video-charades": _charades,
    "video-nextqa": _nextqa,
}


def list_real_workloads() -> list[str]:
    """Names accepted by :func:`real_workload`."""
    return list(_REAL)


def real_workload(name: str, data_dir: str | Path) -> SampleTable:
    """The table of real workload ``name``; ``data_dir`` is ``shared/data`` or its ``metadata`` folder."""
    if name not in _REAL:
        raise InvalidInput(f"unknown real workload {name!r} (known: {', '.join(_REAL)})")
    d = Path(data_dir)
    if (d / "metadata").is_dir():
        d = d / "metadata"
    if not d.is_dir():
        raise InvalidInput(f"real workload: data directory not found: {data_dir}")
    return _REAL[name](d)
