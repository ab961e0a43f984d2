"""Build a sample index (``SampleTable``) from WebDataset shards and Parquet tables, from headers.

Public API (stable; ``entrain-data index`` calls it):

``build_index(paths, *, tokenizer=None, progress=True, on_error="raise", parquet_columns=None,
skipped=None, metadata=None, captions="first") -> SampleTable``

- ``paths``: shards (``.tar``, ``.tgz``, ``.tar.gz``), tables (``.parquet``) and local folders of
  loose files (:mod:`.loose_files`: ``name.jpg`` + ``name.txt``/``name.json``), metadata files
  (:mod:`.metadata_source`: ``.json``/``.jsonl``/``.csv``, one sample per record; a folder or
  object-storage prefix holding ``metadata`` (a file name) or ``metadata.jsonl``/``.csv``/
  ``.parquet`` is read through it (:mod:`.path_patterns`), its fields mapped by
  ``parquet_columns``, list-of-captions text by ``captions``), brace patterns and globs allowed
  (``data/shard-{000..127}.tar``); shards, tables and metadata files may be ``s3://``, ``gs://``
  or ``https://`` URLs (:mod:`.storage`), read by byte range: one pass over a shard in 4 MiB
  ranges (tar headers, text and audio members, the first 64 KiB of each image: its header).
- Shards: a sample is the group of members sharing a key (see :mod:`.sources`). Image sizes come
  from the image headers (PIL opens lazily, no pixel decode), audio durations from the audio
  headers (soundfile; ``wave`` as fallback), text tokens from ``tokenizer``: a Hugging Face
  tokenizer (anything with ``.encode``) or, by default, the byte-level tokenizer of
  :mod:`.tokenizer`, whose count is exact for the default packer (one token per UTF-8 byte plus
  BOS/EOS; about 4x a BPE count: give the training tokenizer for exact counts). Video members (``mp4``,
  ``avi``, ...) are indexed from their container headers (PyAV) as vision items of
  :func:`.decode.sampled_frames` frames; a sample with only unknown members is an error.
- Tables: ``parquet_columns`` maps roles to column names: ``key`` (default: ``"<file>:<row>"``),
  ``text`` (string column, tokenised as above; default ``"text"`` if present), ``text_tokens``
  (precomputed counts, instead of ``text``), ``image_height`` / ``image_width`` (int or list of
  ints per row), ``image_frames`` (same shape; default 1), ``audio_seconds`` (float or list);
  or ``image`` / ``audio``: columns of encoded bytes (or lists of them, or Hugging Face
  ``{"bytes": ...}`` structs), whose sizes are then read from their headers. The mapping is
  stored in the index (``SampleTable.column_map``), so ``serve`` reads the rows the same way.
- ``on_error``: ``raise`` stops at the first bad sample with a SampleError naming shard and key;
  ``skip`` leaves it out, logs it (debug) and appends ``{"key", "source", "error"}`` to
  ``skipped`` (the CLI writes them to a file and prints one summary line).

Every file's identity, taken before it is read (:func:`.source_identity.probe_identity`: size,
mtime and a fingerprint of its first and last 64 KiB, or size and ETag / version), is stored in the
index (``SampleTable.source_identity``), so workers refuse a file replaced since but serve a copy
that did not keep its mtime (folders of loose files are not recorded).

Keys a mapped ``key`` column or field gives are the user's: a repeat is refused naming both
records, never renamed. Keys the index makes (shard member keys, ``<table>:<row>``,
``<metadata file>:<line>``) repeated across files take the file's name, or its path below the
folder common to them, as a prefix (:func:`.index_keys.unique_keys`). The result is validated by
:class:`~entrain_data.metadata.SampleTable` (unique keys, sizes >= 1...).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import SampleMeta, SampleTable, VisionItem

from . import decode
from .index_keys import Claimed, claim, unique_keys
from .loose_files import DirectorySource
from .metadata_source import MetadataSource, is_metadata_file
from .source_identity import probe_identity
from .sources import PARQUET_SUFFIXES, TarShard, expand_paths, row_members
from .storage import INDEX_BLOCK, is_dir, open_parquet
from .tokenizer import TextTokenizer, as_tokenizer, count_text_tokens

__all__ = ["build_index", "index_shard", "index_parquet", "sample_meta_from_members"]

PARQUET_ROLES = ("key", "text", "text_tokens", "image", "audio", "image_height", "image_width",
                 "image_frames", "audio_seconds")  # fmt: skip
"""Roles a Parquet table's columns may be mapped to (module doc); another is a typo, refused."""

log = logging.getLogger(__name__)


def sample_meta_from_members(
    key: str, source: str, member: str, members: Mapping[str, bytes], tokenizer: TextTokenizer
) -> SampleMeta:
    """Metadata of one WebDataset sample from its member bytes (headers only)."""
    try:
        segments = decode.text_segments(members)
        images, secs = [], []
        for ext in sorted(members):
            kind = decode.member_kind(ext)
            if kind == "image":
                h, w = decode.image_size(decode.member_payload(ext, members[ext]))
                images.append(VisionItem(1, h, w))
            elif kind == "video":  # container header only; frames by the cost model's rule
                v = decode.probe_video(decode.member_payload(ext, members[ext]))
                images.append(VisionItem(decode.sampled_frames(v.seconds), v.height, v.width))
            elif kind == "audio":
                secs.append(decode.audio_seconds(decode.member_payload(ext, members[ext])))
        return SampleMeta(
            key=key,
            source=source,
            member=member,
            text_tokens=count_text_tokens(segments, tokenizer),
            images=tuple(images),
            audio_seconds=tuple(secs),
        )
    except (ValueError, InvalidInput) as exc:
        raise SampleError(f"{source}: sample {member!r}: {exc}", source=source, key=key) from exc


_HEADER_BYTES = 1 << 16
"""Bytes of an image member the index reads first: its header (size) lies in them nearly always."""


def _read_for_index(
    src: TarShard | DirectorySource | MetadataSource, member: str
) -> dict[str, bytes]:
    """A sample's members as the index needs them: text and audio whole, images by header.

    An image's size is in its first bytes, so a large picture costs 64 KiB of reading; one whose
    header lies further in (a huge EXIF block) is read again whole.
    """
    heads = [
        e for e in src.members(member) if decode.member_kind(e) == "image" and not e.endswith(".gz")
    ]
    out = src.read(member, None, limit=dict.fromkeys(heads, _HEADER_BYTES))
    for ext in heads:
        if len(out[ext]) == _HEADER_BYTES:
            try:
                decode.image_size(out[ext])
            except ValueError:
                out[ext] = src.read(member, [ext])[ext]
    return out


def index_shard(
    path: str,
    tokenizer: TextTokenizer,
    *,
    on_error: str = "raise",
    skipped: list[dict[str, str]] | None = None,
    notes: dict[str, str] | None = None,
) -> list[SampleMeta]:
    """Records of every sample of one tar shard or folder of loose files (WebDataset keys);
    ``notes`` gets what a folder passed over, for the error when nothing is found."""
    out: list[SampleMeta] = []
    src: TarShard | DirectorySource = (
        DirectorySource(path)
        if is_dir(path)
        else TarShard(path, block_size=INDEX_BLOCK, sequential=True)  # one pass, big ranges
    )
    try:
        keys = src.keys()
        if isinstance(src, DirectorySource) and src.passed_over:
            note = f"passed over {src.passed_over} file group(s) without an image or audio file"
            log.warning("%s: %s", path, note)
            if notes is not None:
                notes[path] = note
        for member in keys:
            try:
                members = _read_for_index(src, member)
                out.append(sample_meta_from_members(member, path, member, members, tokenizer))
            except SampleError as exc:
                if on_error == "raise":
                    raise
                _skip(skipped, member, path, exc)
    finally:
        src.close()
    return out


def _skip(skipped: list[dict[str, str]] | None, key: str, source: str, exc: Exception) -> None:
    """Record a skipped sample; one debug line each (the CLI prints one summary line)."""
    log.debug("index: skipping %s", exc)
    if skipped is not None:
        skipped.append({"key": key, "source": source, "error": str(exc)})


def index_metadata(
    path: str,
    tokenizer: TextTokenizer,
    columns: Mapping[str, str] | None = None,
    *,
    captions: str = "first",
    on_error: str = "raise",
    skipped: list[dict[str, str]] | None = None,
    seen: Claimed | None = None,
) -> tuple[list[SampleMeta], dict[str, str]]:
    """Records of every record of a metadata file (:mod:`.metadata_source`) and the resolved
    column mapping (stored in the index, so ``serve`` reads the records the same way).
    ``seen``: the user keys of the files indexed before (:func:`.index_keys.claim`)."""
    src = MetadataSource(path, columns, captions)
    seen = {} if seen is None else seen
    made = os.path.basename(path) + ":"  # a record without a key value: "<file>:<line>"
    out: list[SampleMeta] = []
    for member in src.keys():  # noqa: SIM118 - a source, not a dict
        key = member
        try:
            key = src.key(member)
            line = src.line(member)
            if "key" in src.columns and key.partition("#")[0] != f"{made}{line}":
                claim(seen, key, path, f"{path}:{line}", src.columns["key"])
            members = _read_for_index(src, member)
            out.append(sample_meta_from_members(key, path, member, members, tokenizer))
        except SampleError as exc:
            where = f"{path}:{src.line(member)}:"  # a bad record names its file and line
            msg = str(exc) if str(exc).startswith(where) else f"{where} {exc.__cause__ or exc}"
            err = SampleError(msg, source=path, key=key)
            if on_error == "raise":
                raise err from exc
            _skip(skipped, key, path, err)
    return out, src.columns


def _as_list(v: Any) -> list[Any]:
    if v is None:
        return []
    if isinstance(v, (list, tuple, np.ndarray)):
        return list(v)
    return [v]


def index_parquet(
    path: str,
    tokenizer: TextTokenizer,
    columns: Mapping[str, str] | None = None,
    *,
    on_error: str = "raise",
    skipped: list[dict[str, str]] | None = None,
    seen: Claimed | None = None,
) -> list[SampleMeta]:
    """Records of every row of a Parquet table, its columns mapped by ``columns`` (module doc).
    ``seen``: the user keys of the tables indexed before (:func:`.index_keys.claim`)."""
    cols = dict(columns or {})
    seen = {} if seen is None else seen
    unknown = sorted(set(cols) - set(PARQUET_ROLES))
    if unknown:  # a misspelt role (audio_secs) would be stored and silently read as nothing
        raise InvalidInput(
            f"{path}: unknown role {unknown[0]!r} in the column mapping (roles: "
            f"{', '.join(PARQUET_ROLES)})"
        )
    try:
        pf = open_parquet(path)
    except Exception as exc:
        raise InvalidInput(f"{path}: not a readable Parquet table ({exc})") from exc
    names = set(pf.schema_arrow.names)
    if "text" not in cols and "text_tokens" not in cols and "text" in names:
        cols["text"] = "text"
    for role, name in cols.items():
        if name not in names:
            raise InvalidInput(f"{path}: column {name!r} (for {role!r}) not in the table")
    if "text" not in cols and "text_tokens" not in cols:
        raise InvalidInput(
            f"{path}: no 'text' column; map one with --column text=COLUMN (or token counts "
            "with --column text_tokens=COLUMN)"
        )
    try:
        table = pf.read(columns=sorted(set(cols.values())))
    finally:
        pf.close()
    data = {role: table.column(name).to_pylist() for role, name in cols.items()}
    out: list[SampleMeta] = []
    for row in range(table.num_rows):
        user = data["key"][row] if "key" in data else None  # a null key: the row's, as metadata
        key = f"{os.path.basename(path)}:{row}" if user is None else str(user)
        if user is not None:
            claim(seen, key, path, f"{path} row {row}", cols["key"])
        try:
            blobs = row_members({c: data[r][row] for r, c in cols.items()}, cols)
            if "text_tokens" in data:
                n_text = int(data["text_tokens"][row])
            else:
                if data["text"][row] is None:
                    raise ValueError("text is null")
                # the text as the packer renders it (a conversation column: its turns)
                n_text = count_text_tokens(decode.text_segments(blobs), tokenizer)
            heads = [(e, decode.member_payload(e, b)) for e, b in sorted(blobs.items())]
            hs = _as_list(data.get("image_height", [None] * table.num_rows)[row])
            ws = _as_list(data.get("image_width", [None] * table.num_rows)[row])
            fs = _as_list(data.get("image_frames", [None] * table.num_rows)[row]) or [1] * len(hs)
            if "image" in cols and "image_height" not in cols:  # sizes from the image headers
                sizes = [decode.image_size(b) for e, b in heads if decode.member_kind(e) == "image"]
                hs, ws, fs = [h for h, _ in sizes], [w for _, w in sizes], [1] * len(sizes)
            if not (len(hs) == len(ws) == len(fs)):
                raise ValueError(f"image columns list {len(hs)}/{len(ws)}/{len(fs)} items")
            images = tuple(VisionItem(int(f), int(h), int(w)) for f, h, w in zip(fs, hs, ws))
            secs = tuple(
                float(s) for s in _as_list(data.get("audio_seconds", [None] * table.num_rows)[row])
            )
            if "audio" in cols and "audio_seconds" not in cols:  # durations from the headers
                secs = tuple(
                    decode.audio_seconds(b) for e, b in heads if decode.member_kind(e) == "audio"
                )
            out.append(SampleMeta(key, path, n_text, images, secs, member="", row=row))
        except (ValueError, TypeError, InvalidInput, SampleError) as exc:
            err = SampleError(f"{path}: row {row} (key {key!r}): {exc}", source=path, key=key)
            if on_error == "raise":
                raise err from exc
            _skip(skipped, key, path, err)
    return out


def _hint_metadata(folder: str, exc: SampleError) -> None:
    """A folder of media without sidecar text but with a JSON/JSONL/CSV file: name it."""
    order = (".jsonl", ".csv", ".json")  # one record per line first: likelier a sample list
    cands = sorted(
        (n for n in os.listdir(folder) if n.endswith(order) and n[0] != "."),
        key=lambda n: ([n.endswith(x) for x in order].index(True), n),
    )
    if cands:
        raise SampleError(
            f"{exc}; if a metadata file describes the samples, give --metadata "
            f"{' or '.join(cands[:3])} (and --column text=FIELD, media=FIELD as needed)",
            source=exc.source,
            key=exc.key,
        ) from exc


def _nothing_found(files: Sequence[str], notes: Mapping[str, str]) -> InvalidInput:
    """Inputs that hold no sample at all, said as such: an empty index only fails later."""
    named = [f"{f} ({notes.get(f, 'no samples in it')})" for f in files[:3]]
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    n = len(files)
    return InvalidInput(f"no sample found in {n} input{'s' * (n > 1)}: {', '.join(named)}{more}")


def _identity_before_reading(path: str) -> dict[str, int | str] | None:
    """``path``'s identity before its samples are read, so a file changed while it was indexed
    reads as changed later; None for a folder, or a file the probe cannot reach (reading it then
    fails with the real error, or serves it unchecked)."""
    if is_dir(path):
        return None
    try:
        return probe_identity(path, fingerprint=True)  # a copy's new mtime is then no change
    except OSError as exc:
        log.debug("index: no identity recorded for %s (%s)", path, exc)
        return None


def build_index(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    tokenizer: Any = None,
    progress: bool = True,
    on_error: str = "raise",
    parquet_columns: Mapping[str, str] | None = None,
    skipped: list[dict[str, str]] | None = None,
    metadata: str | None = None,
    captions: str = "first",
) -> SampleTable:
    """Index shards, tables, folders and metadata files (module doc); keys unique across all."""
    if on_error not in ("raise", "skip"):
        raise InvalidInput(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    files: Sequence[str] = expand_paths(paths, metadata=metadata)  # folders: their metadata file
    if not files:
        raise InvalidInput("build_index: no shards or tables given")
    # with --metadata every input resolved to the file it names, whatever it is called
    metas = list(files) if metadata else [f for f in files if is_metadata_file(f)]
    if metas and any(f.endswith(PARQUET_SUFFIXES) and f not in metas for f in files):
        raise InvalidInput(
            "index Parquet tables and metadata files separately (each index stores one mapping)"
        )
    tok = as_tokenizer(tokenizer)
    skipped = [] if skipped is None else skipped
    skips_before = len(skipped)
    seen: Claimed = {}  # user keys, across every file
    notes: dict[str, str] = {}  # what folders passed over
    records: list[SampleMeta] = []
    identities: dict[str, dict[str, int | str]] = {}
    meta_columns: dict[str, str] | None = None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), unit="file", desc="index", dynamic_ncols=True)
    try:
        for path in files:
            if (ident := _identity_before_reading(path)) is not None:
                identities[path] = ident
            if path in metas:
                recs, cols = index_metadata(
                    path,
                    tok,
                    parquet_columns,
                    captions=captions,
                    on_error=on_error,
                    skipped=skipped,
                    seen=seen,
                )
                if meta_columns is not None and cols != meta_columns:
                    raise InvalidInput(
                        f"{path}: fields {cols} differ from the other metadata files' "
                        f"{meta_columns}; index them separately"
                    )
                meta_columns = cols
            elif path.endswith(PARQUET_SUFFIXES):
                recs = index_parquet(
                    path, tok, parquet_columns, on_error=on_error, skipped=skipped, seen=seen
                )
            else:
                try:
                    recs = index_shard(path, tok, on_error=on_error, skipped=skipped, notes=notes)
                except SampleError as exc:
                    if on_error == "raise" and "no text member" in str(exc) and is_dir(path):
                        _hint_metadata(path, exc)
                    if on_error == "raise" or exc.key is not None:
                        raise
                    log.debug("index: skipping unreadable shard %s", exc)  # no key to name
                    skipped.append({"key": "", "source": path, "error": str(exc)})
                    recs = []
            records.extend(recs)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(samples=len(records))
    finally:
        if bar is not None:
            bar.close()
    if not records and len(skipped) == skips_before:
        raise _nothing_found(files, notes)
    records = unique_keys(records, {(src, k) for k, (src, _) in seen.items()})
    origin = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"
    column_map = dict(parquet_columns or {})
    if meta_columns is not None:
        column_map = meta_columns  # the fields as resolved, stated for serve
    elif any(f.endswith(PARQUET_SUFFIXES) for f in files):
        if "text" not in column_map and "text_tokens" not in column_map:
            column_map["text"] = "text"  # index_parquet's default, stated for serve
    else:
        column_map = {}
    used = {r.source for r in records}
    return SampleTable.from_records(
        records,
        origin=origin,
        column_map=column_map,
        source_identity={p: i for p, i in identities.items() if p in used},
    )
