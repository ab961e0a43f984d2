"""Fetch, decode, transform and pack one microbatch (encoder set + LLM set) into numpy arrays.

Public API (stable; the worker processes call :func:`make_packer`):

- ``make_packer(index_path, *, on_error="raise", transform=None, model=None, vision=None,
  audio=None, tokenizer=None, max_open=64, jpeg_draft=False) -> SamplePacker``. ``model``: a
  ``ModelSpec`` or its dict (``ParallelPlan.model``); its first vision and first audio encoder
  define the transforms (``vision``/``audio``: a preset name, JSON path, dict or ModuleConfig
  override them). Without either, the presets ``qwen2.5-vl-vision`` and
  ``whisper-large-v3-encoder`` are used. A configuration the default transforms cannot serve
  raises ``InvalidInput`` here, at construction (build one in the parent before any worker).
- ``SamplePacker(encoder_rows, llm_rows) -> Packed`` (``workers.worker.Packed``): table rows in,
  tensors named as in :mod:`entrain_data.batch` out (pixels as uint8, normalised by
  ``Microbatch.to``; ``meta`` carries ``pixel_mean``/``pixel_std``/``temporal_patch``); with ``on_error="skip"`` bad samples are left
  out of both sets and listed in ``Packed.skipped``. ``validate_deferred`` (default: on with
  ``skip``, off with ``raise``) decodes an LLM-only sample's media too, only to reach the same
  skip decision as the microbatch that encodes it; with ``raise`` nothing of it is decoded.
  Parquet rows: ``parquet_columns`` maps ``text`` (default ``"text"``), ``image`` and ``audio``
  (bytes or lists of bytes) to columns, as :func:`.sources.row_members` reads them.
- ``DecodedSample``: what a user ``transform(sample) -> sample`` receives (after decode, before
  patching / mel / tokenisation). ``llm_only`` samples carry text only.
- ``EncoderInput``, ``LLMInput`` and ``pack_microbatch(encoder, llm, *, image_token_id,
  audio_token_id) -> dict[str, np.ndarray]``: the pure packing step (no I/O).

The sequence of one sample is ``[BOS] <image placeholders per vision item> <audio placeholders per
clip> text... [EOS]``; vision items are the index's (images, then video clips: ``frames > 1``, the
cost model's own rule), all with ``image_token_id``; ``labels[t]`` is ``input_ids[t + 1]`` where that token carries a loss, else -100
(the last token of every sample has none). Placeholder counts come from the index sizes through the
cost model's token functions (see :mod:`.transforms`), so an LLM-only pack, which decodes nothing,
agrees with the microbatch that ran the encoder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import SampleTable, read_index
from entrain_data.presets import ModelSpec, ModuleConfig, load_module

from . import decode
from .sources import SourceCache, open_source, parquet_metadata_files, row_members
from .tokenizer import TextTokenizer, as_tokenizer, sample_text_ids
from .transforms import SAMPLE_RATE, AudioTransform, VisionTransform, resize_rgb

__all__ = [
    "DecodedSample",
    "EncoderInput",
    "LLMInput",
    "SamplePacker",
    "make_packer",
    "pack_microbatch",
    "resolve_encoders",
    "DEFAULT_VISION",
    "DEFAULT_AUDIO",
]

log = logging.getLogger(__name__)

DEFAULT_VISION = "qwen2.5-vl-vision"
DEFAULT_AUDIO = "whisper-large-v3-encoder"


@dataclass(frozen=True)
class DecodedSample:
    """A decoded sample as a user transform sees it; return a (modified) copy via ``replace``."""

    key: str
    source: str
    segments: tuple[decode.TextSegment, ...]
    images: tuple[np.ndarray, ...] = ()  # uint8 [H, W, 3] at VisionTransform.target_size
    audio: tuple[np.ndarray, ...] = ()  # float32 waveforms at 16 kHz
    llm_only: bool = False
    videos: tuple[np.ndarray, ...] = ()  # uint8 [T, H, W, 3] sampled frames at the target size


@dataclass(frozen=True)
class EncoderInput:
    """One encoder-set sample: patches per image and log-mel frames per clip."""

    key: str
    patches: tuple[np.ndarray, ...]  # uint8 [P_i, C*p*p] each
    grids: tuple[tuple[int, int, int], ...]
    mels: tuple[np.ndarray, ...]  # [F_c, n_mels] each
    video_patches: tuple[np.ndarray, ...] = ()  # uint8 [P_v, C*tp*p*p] each
    video_grids: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class LLMInput:
    """One LLM-set sample: text ids/loss mask and its placeholder counts per item."""

    key: str
    text_ids: np.ndarray  # int64, [BOS] text [EOS]
    loss_mask: np.ndarray  # bool, same length
    image_tokens: tuple[int, ...] = ()
    audio_tokens: tuple[int, ...] = ()
    prefix: int = 1  # ids before the placeholders (BOS)


def _sample_sequence(s: LLMInput, image_id: int, audio_id: int) -> tuple[np.ndarray, np.ndarray]:
    n_img, n_aud = sum(s.image_tokens), sum(s.audio_tokens)
    ids = s.text_ids
    bos = min(s.prefix, len(ids))  # placeholders go right after BOS
    seq = np.concatenate(
        [
            ids[:bos],
            np.full(n_img, image_id, np.int64),
            np.full(n_aud, audio_id, np.int64),
            ids[bos:],
        ]
    )
    loss = np.concatenate([s.loss_mask[:bos], np.zeros(n_img + n_aud, bool), s.loss_mask[bos:]])
    labels = np.full(len(seq), -100, dtype=np.int64)
    if len(seq) > 1:
        take = loss[1:]
        labels[:-1][take] = seq[1:][take]
    return seq, labels


def pack_microbatch(
    encoder: Sequence[EncoderInput],
    llm: Sequence[LLMInput],
    *,
    image_token_id: int,
    audio_token_id: int,
    patch_dim: int = 0,
    n_mels: int = 0,
) -> dict[str, np.ndarray]:
    """The tensors of :mod:`entrain_data.batch` for an encoder set and an LLM set (pure, no I/O).

    Vision/audio tensors are present only when the encoder set has images/audio.
    """
    out: dict[str, np.ndarray] = {}
    seqs = [_sample_sequence(s, image_token_id, audio_token_id) for s in llm]
    lens = np.array([len(q) for q, _ in seqs], dtype=np.int64)
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    out["input_ids"] = np.concatenate([q for q, _ in seqs]) if seqs else np.zeros(0, np.int64)
    out["labels"] = np.concatenate([lb for _, lb in seqs]) if seqs else np.zeros(0, np.int64)
    out["position_ids"] = (
        np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)
        if total
        else np.zeros(0, np.int64)
    )
    out["cu_seqlens"] = cu
    out["llm_vision_tokens"] = np.array([sum(s.image_tokens) for s in llm], dtype=np.int64)
    out["llm_audio_tokens"] = np.array([sum(s.audio_tokens) for s in llm], dtype=np.int64)
    for name, grid, owner, attr in (
        ("pixel_values", "image_grid_thw", "image_sample", "patches"),
        ("pixel_values_videos", "video_grid_thw", "video_sample", "video_patches"),
    ):
        grids = "grids" if attr == "patches" else "video_grids"
        items = [
            (i, p, g)
            for i, s in enumerate(encoder)
            for p, g in zip(getattr(s, attr), getattr(s, grids))
        ]
        if items:  # uint8 stays uint8 on the wire (Microbatch.to normalises on the device)
            out[name] = np.concatenate([p for _, p, _ in items])
            out[grid] = np.array([g for _, _, g in items], dtype=np.int64).reshape(-1, 3)
            out[owner] = np.array([i for i, _, _ in items], dtype=np.int64)
    mels = [(i, m) for i, s in enumerate(encoder) for m in s.mels]
    if mels:
        out["audio_features"] = np.concatenate([m for _, m in mels]).astype(np.float32, copy=False)
        out["audio_lengths"] = np.array([len(m) for _, m in mels], dtype=np.int64)
        out["audio_sample"] = np.array([i for i, _ in mels], dtype=np.int64)
    return out


def _module(x: Any, default: str) -> ModuleConfig:
    if isinstance(x, ModuleConfig):
        return x
    if isinstance(x, Mapping):
        return ModuleConfig.from_dict(dict(x))
    return load_module(x if x is not None else default)


def resolve_encoders(
    model: ModelSpec | Mapping[str, Any] | None = None, vision: Any = None, audio: Any = None
) -> tuple[ModuleConfig, ModuleConfig]:
    """The vision and audio ModuleConfigs the packer uses (see :func:`make_packer`)."""
    spec = ModelSpec.from_dict(dict(model)) if isinstance(model, Mapping) else model
    v_def: Any = DEFAULT_VISION
    a_def: Any = DEFAULT_AUDIO
    if spec is not None:
        for enc in spec.encoders:
            if enc.kind == "vision" and v_def == DEFAULT_VISION:
                v_def = enc
            if enc.kind == "audio" and a_def == DEFAULT_AUDIO:
                a_def = enc
    v = _module(vision, DEFAULT_VISION) if vision is not None else _module(v_def, DEFAULT_VISION)
    a = _module(audio, DEFAULT_AUDIO) if audio is not None else _module(a_def, DEFAULT_AUDIO)
    return v, a


class SamplePacker:
    """Reads table rows from their sources, decodes, transforms and packs (one per worker)."""

    def __init__(
        self,
        table: SampleTable,
        *,
        vision: ModuleConfig,
        audio: ModuleConfig,
        tokenizer: TextTokenizer,
        transform: Callable[[DecodedSample], DecodedSample] | None = None,
        on_error: str = "raise",
        max_open: int = 64,
        validate_deferred: bool | None = None,
        parquet_columns: Mapping[str, str] | None = None,
        jpeg_draft: bool = False,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise InvalidInput(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.table = table
        # both raise InvalidInput for a configuration the default transforms cannot serve: the
        # service builds one packer in the parent, so that is one line before any worker starts
        self.vision = VisionTransform(vision)
        self.audio = AudioTransform(audio)
        self.jpeg_draft = bool(jpeg_draft)
        self.tokenizer = tokenizer
        self.transform = transform
        self.on_error = on_error
        # skip policy: an LLM-only sample whose media fail in the microbatch that encodes it
        # (another task, maybe another worker) must be skipped here too, or its placeholders
        # would wait for encoder output that never comes; decoding it again (the same
        # deterministic check) gives both sides the same decision without talking to each other
        self.validate_deferred = (
            on_error == "skip" if validate_deferred is None else validate_deferred
        )
        self.parquet_columns = dict(parquet_columns or {"text": "text"})
        _check_servable(table, self.parquet_columns)
        self.sources = SourceCache(  # metadata files read their records by the index's mapping
            max_open,
            opener=partial(
                open_source,
                metadata_columns=table.column_map or None,
                metadata_files=parquet_metadata_files(
                    table.sources, table.members, table.source_identity
                ),
            ),
            identities=table.source_identity,  # a file changed since indexing is refused
        )

    # ---------------------------------------------------------------- reading
    def _items(self, row: int) -> tuple[list[tuple[int, int, int]], list[float]]:
        t = self.table
        a, b = int(t.image_offsets[row]), int(t.image_offsets[row + 1])
        c, d = int(t.audio_offsets[row]), int(t.audio_offsets[row + 1])
        imgs = [
            (int(t.image_frames[i]), int(t.image_height[i]), int(t.image_width[i]))
            for i in range(a, b)
        ]
        return imgs, [float(s) for s in t.audio_seconds[c:d]]

    def _members(self, row: int, kinds: Sequence[str]) -> dict[str, bytes]:
        src, member = str(self.table.sources[row]), str(self.table.members[row])
        if not member:  # a Parquet table row
            cols = self.parquet_columns
            wanted = {
                r: c for r, c in cols.items() if r in kinds and r in ("text", "image", "audio")
            }
            if "text" not in wanted:
                raise SampleError(
                    f"{src}: row {int(self.table.rows[row])}: give make_packer parquet_columns "
                    "with at least a 'text' column",
                    source=src,
                    key=str(self.table.keys[row]),
                )
            values = self.sources.get(src).read(
                int(self.table.rows[row]), sorted(set(cols.values()))
            )
            try:
                return row_members(values, wanted)
            except SampleError as exc:
                raise SampleError(
                    f"{src}: row {int(self.table.rows[row])}: {exc}",
                    source=src,
                    key=str(self.table.keys[row]),
                ) from exc
        shard = self.sources.get(src)
        exts = [e for e in shard.members(member) if decode.member_kind(e) in kinds]
        return shard.read(member, exts)

    def _decode(self, row: int, llm_only: bool) -> DecodedSample:
        key, src = str(self.table.keys[row]), str(self.table.sources[row])
        try:
            media = not llm_only or self.validate_deferred
            kinds = ("text", "image", "video", "audio") if media else ("text",)
            members = self._members(row, kinds)
            segments = tuple(decode.text_segments(members))
            images: list[np.ndarray] = []
            videos: list[np.ndarray] = []
            audio: list[np.ndarray] = []
            if media:
                sizes, secs = self._items(row)
                vis_exts = sorted(e for e in members if decode.member_kind(e) in ("image", "video"))
                aud_exts = sorted(e for e in members if decode.member_kind(e) == "audio")
                if len(vis_exts) != len(sizes) or len(aud_exts) != len(secs):
                    raise ValueError(
                        f"sample has {len(vis_exts)} image+video / {len(aud_exts)} audio members "
                        f"but the index lists {len(sizes)} / {len(secs)} (stale index?)"
                    )
                for ext, (frames, h, w) in zip(vis_exts, sizes):
                    data = decode.member_payload(ext, members[ext])
                    target = self.vision.target_size(h, w, frames)
                    if (decode.member_kind(ext) == "video") != (frames > 1):
                        raise ValueError(
                            f"member .{ext} is indexed with {frames} frame(s) (stale index?)"
                        )
                    if frames > 1:
                        videos.append(np.stack(decode.decode_video(data, frames, target)))
                    else:
                        images.append(decode.decode_image(data, target, draft=self.jpeg_draft))
                for ext in aud_exts:
                    audio.append(
                        decode.decode_audio(decode.member_payload(ext, members[ext]), SAMPLE_RATE)
                    )
        except SampleError as exc:
            if exc.key == key and exc.source == src:
                raise
            # name the sample by its index key (a shard names it by its member, maybe prefixed)
            msg = str(exc) if repr(key) in str(exc) else f"{exc} (sample {key!r})"
            raise SampleError(msg, source=src, key=key) from exc
        except ValueError as exc:
            raise SampleError(f"{src}: sample {key!r}: {exc}", source=src, key=key) from exc
        if llm_only:  # decoded for validation only: an LLM-only sample carries its text
            images, audio, videos = [], [], []
        sample = DecodedSample(
            key, src, segments, tuple(images), tuple(audio), llm_only, tuple(videos)
        )
        if self.transform is not None:
            sample = self.transform(sample)
        return sample

    # ---------------------------------------------------------------- packing
    def _encoder_input(self, row: int, s: DecodedSample) -> EncoderInput:
        sizes, secs = self._items(row)
        patches, grids, vpatches, vgrids = [], [], [], []
        for img, (_f, h, w) in zip(s.images, [x for x in sizes if x[0] == 1]):
            # a user transform may have changed the size: back to the target (as the index says)
            p, g = self.vision.encode_image(resize_rgb(img, *self.vision.target_size(h, w)))
            patches.append(p)
            grids.append(g)
        for clip, (f, h, w) in zip(s.videos, [x for x in sizes if x[0] > 1]):
            th, tw = self.vision.target_size(h, w, f)
            p, g = self.vision.encode_video([resize_rgb(x, th, tw) for x in clip])
            vpatches.append(p)
            vgrids.append(g)
        mels = tuple(self.audio.features(wav, sec) for wav, sec in zip(s.audio, secs))
        return EncoderInput(
            s.key, tuple(patches), tuple(grids), mels, tuple(vpatches), tuple(vgrids)
        )

    def _llm_input(self, row: int, s: DecodedSample) -> LLMInput:
        sizes, secs = self._items(row)
        ids, mask = sample_text_ids(s.segments, self.tokenizer)
        return LLMInput(
            s.key,
            ids,
            mask,
            tuple(
                self.vision.llm_tokens(h, w, f)
                for f, h, w in sorted(sizes, key=lambda x: x[0] > 1)  # images, then clips
            ),
            tuple(self.audio.llm_tokens(sec) for sec in secs),
            prefix=int(self.tokenizer.bos_id is not None),
        )

    def __call__(self, encoder_rows: Sequence[int], llm_rows: Sequence[int]):
        from .worker import Packed  # the worker's result type (kept there, its owner's module)

        skipped: list[dict[str, str]] = []
        bad: set[int] = set()
        decoded: dict[int, DecodedSample] = {}
        llm_set, enc_set = set(llm_rows), set(encoder_rows)
        n = len(self.table)
        wrong = [r for r in (*encoder_rows, *llm_rows) if not 0 <= r < n]
        if wrong:
            raise InvalidInput(
                f"{self.table.origin}: rows {wrong[:5]} outside the index (0..{n - 1})"
            )
        for row in list(encoder_rows) + [r for r in llm_rows if r not in enc_set]:
            if row in decoded or row in bad:
                continue
            try:
                decoded[row] = self._decode(row, llm_only=row not in enc_set)
            except SampleError as exc:
                if self.on_error == "raise":
                    raise
                log.warning("skipping sample: %s", exc)
                skipped.append({"key": str(exc.key), "source": str(exc.source), "error": str(exc)})
                bad.add(row)
        enc = [self._encoder_input(r, decoded[r]) for r in encoder_rows if r not in bad]
        llm = [self._llm_input(r, decoded[r]) for r in llm_rows if r in llm_set and r not in bad]
        tensors = pack_microbatch(
            enc,
            llm,
            image_token_id=self.tokenizer.image_token_id,
            audio_token_id=self.tokenizer.audio_token_id,
        )
        meta = {
            "image_token_id": int(self.tokenizer.image_token_id),
            "audio_token_id": int(self.tokenizer.audio_token_id),
            "patch_dim": self.vision.patch_dim,
            "n_mels": self.audio.n_mels,
            "pixel_mean": [float(x) for x in self.vision.cfg.image_mean],
            "pixel_std": [float(x) for x in self.vision.cfg.image_std],
            "temporal_patch": int(self.vision.tp),
        }
        return Packed(
            encoder_keys=[e.key for e in enc],
            llm_keys=[s.key for s in llm],
            tensors=tensors,
            meta=meta,
            skipped=skipped,
        )

    def close(self) -> None:
        self.sources.close()


def _check_servable(table: SampleTable, columns: Mapping[str, str]) -> None:
    """A Parquet index built from counts and sizes alone (``text_tokens``, ``image_height``...)
    profiles and plans, but holds nothing to serve: say so once, not as a skip per row."""
    rows = np.asarray(table.members) == ""
    if not rows.any():
        return
    img = np.diff(np.asarray(table.image_offsets))[rows].any()
    aud = np.diff(np.asarray(table.audio_offsets))[rows].any()
    missing = [
        role
        for role, has in (("text", True), ("image", img), ("audio", aud))
        if has and role not in columns
    ]
    if missing:
        raise InvalidInput(
            f"{table.origin}: the index's Parquet rows have no {'/'.join(missing)} column to "
            f"serve (mapping {dict(columns)}): an index of counts and sizes plans but cannot be "
            "served; index the table with the column(s) holding the text and encoded media "
            "(--column text=COL --column image=COL --column audio=COL)"
        )


def make_packer(
    index_path: str,
    *,
    on_error: str = "raise",
    transform: Callable[[DecodedSample], DecodedSample] | None = None,
    model: ModelSpec | Mapping[str, Any] | None = None,
    vision: Any = None,
    audio: Any = None,
    tokenizer: Any = None,
    max_open: int = 64,
    validate_deferred: bool | None = None,
    parquet_columns: Mapping[str, str] | None = None,
    jpeg_draft: bool = False,
) -> SamplePacker:
    """The default packer of a worker process: reads ``index_path`` once (see module doc)."""
    table = read_index(index_path)
    v, a = resolve_encoders(model, vision, audio)
    return SamplePacker(
        table,
        vision=v,
        audio=a,
        tokenizer=as_tokenizer(tokenizer),
        transform=transform,
        on_error=on_error,
        max_open=max_open,
        validate_deferred=validate_deferred,
        # the mapping given at index time, stored in the index, unless the caller overrides it
        parquet_columns=parquet_columns
        if parquet_columns is not None
        else table.column_map or None,
        jpeg_draft=jpeg_draft,
    )
