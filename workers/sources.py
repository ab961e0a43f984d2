"""Random access to samples: WebDataset tar shards, Parquet tables, a wrapped torch Dataset.

Public API (stable; the worker processes and the CLI call these):

- ``expand_paths(patterns, *, metadata=None) -> list[str]``: brace patterns
  (``shard-{000..009}.tar``), globs (files only), object-storage prefixes
  (``s3://bucket/shards/``) and plain paths (:mod:`.path_patterns`); with ``metadata`` each
  folder or prefix resolves to that metadata file.
- ``open_source(path) -> Source``: a :class:`TarShard` (``.tar``, ``.tgz``/``.tar.gz``), a
  :class:`ParquetSource` (``.parquet``), chosen by suffix, or for a local folder a
  :class:`~.loose_files.DirectorySource` (loose files grouped by key as in a tar). Paths may be
  ``s3://``, ``gs://``, ``https://`` URLs (see :mod:`.storage`): byte-range reads.
- ``Source.keys() -> list[str]``; ``Source.read(member) -> dict[str, bytes | Any]``: the members
  of one sample by extension (``{"jpg": b"...", "txt": b"..."}``), optionally only ``exts``.
- ``SourceCache(max_open)``: the open sources of one worker, opened once and kept (LRU).
- ``TorchDatasetSource(dataset)``: a user's torch Dataset, samples addressed by integer index.

A WebDataset sample is the group of tar members sharing a key: the member path up to the first
dot of its basename (``dir/000123.jpg`` -> key ``dir/000123``, extension ``jpg``). A plain tar
shard is scanned once for its member offset table (tar headers only, no payload read), after which
a sample costs one seek and one read per member. A gzip'd shard cannot be seeked: it is
decompressed once, sequentially, on first access and kept in memory (cost: one full decompression
per worker and the shard's uncompressed size in RAM; prefer plain ``.tar`` for large shards).

Every read error is a :class:`~entrain_data.errors.SampleError` naming the shard and the key.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from entrain_data.errors import InvalidInput, SampleError

from . import storage
from .parquet_source import ParquetSource, row_members
from .path_patterns import expand_braces, expand_paths
from .source_identity import vouch

__all__ = [
    "Source",
    "TarShard",
    "ParquetSource",
    "TorchDatasetSource",
    "SourceCache",
    "MemberRef",
    "expand_braces",
    "expand_paths",
    "open_source",
    "parquet_metadata_files",
    "split_member_name",
    "row_members",
    "TAR_SUFFIXES",
    "GZIP_TAR_SUFFIXES",
    "PARQUET_SUFFIXES",
]

log = logging.getLogger(__name__)

TAR_SUFFIXES = (".tar",)
GZIP_TAR_SUFFIXES = (".tgz", ".tar.gz")
PARQUET_SUFFIXES = (".parquet", ".pq")


def split_member_name(name: str) -> tuple[str, str]:
    """``dir/000123.seg.jpg`` -> (``dir/000123``, ``seg.jpg``): the WebDataset key convention."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


class Source(Protocol):
    """What the packer and the index builder need from any source."""

    path: str

    def keys(self) -> list[str]: ...

    def read(self, member: str, exts: Sequence[str] | None = None) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MemberRef:
    """Where one tar member's payload lies: byte offset and size inside the (uncompressed) tar."""

    offset: int
    size: int


def _is_gzip_tar(path: str) -> bool:
    return path.endswith(GZIP_TAR_SUFFIXES)


_GAP = 1 << 20
"""Byte ranges closer than this are fetched as one request: an object-storage request costs
tens of milliseconds before its first byte, the time to stream about a megabyte."""


def _limit(limit: int | Mapping[str, int] | None, ext: str, size: int) -> int:
    if limit is None:
        return size
    if isinstance(limit, int):
        return limit
    return limit.get(ext, size)


def _ranged_read(path: str, spans: Sequence[tuple[str, int, int]]) -> dict[str, bytes]:
    """``{ext: bytes}`` for ``(ext, start, end)`` spans, neighbouring spans in one ranged read."""
    out: dict[str, bytes] = {}
    group: list[tuple[str, int, int]] = []
    for span in sorted(spans, key=lambda s: s[1]) + [("", -1, -1)]:
        if group and (span[1] < 0 or span[1] - max(e for _, _, e in group) > _GAP):
            lo, hi = group[0][1], max(e for _, _, e in group)
            blob = storage.read_range(path, lo, hi)
            for ext, start, end in group:
                out[ext] = blob[start - lo : end - lo]
            group = []
        if span[1] >= 0:
            group.append(span)
    return out


class TarShard:
    """Random access into one WebDataset tar shard by sample key (member offset table, seek+read)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        block_size: int = storage.HEADER_BLOCK,
        sequential: bool = False,
    ) -> None:
        """``block_size``: read-ahead of the header scan over object storage; ``sequential``:
        samples will be read in shard order (the index), so reads go through that read-ahead
        too instead of one ranged GET per sample (random access, the workers)."""
        self.path = os.fspath(path)
        self.remote = storage.is_remote(self.path)
        self._block_size = block_size
        self._sequential = sequential
        self._data: bytes | None = None  # decompressed gzip shard
        self._fh: io.BufferedReader | None = None
        self._lock = threading.Lock()
        self.samples: dict[str, dict[str, MemberRef]] = {}
        self.truncated = False
        self._scan()

    def _open_stream(self) -> io.BufferedIOBase:
        if _is_gzip_tar(self.path):
            if self._data is None:
                self._data = self._gunzip()
            return io.BytesIO(self._data)
        if self._fh is None:
            try:
                self._fh = storage.open_ranged(self.path, self._block_size)  # kept for seeks
            except OSError as exc:
                raise SampleError(
                    f"{self.path}: cannot open shard ({exc})", source=self.path
                ) from exc
        return self._fh

    def _gunzip(self) -> bytes:
        """The whole decompressed tar; a cut-off gzip stream yields what it holds (truncated)."""
        try:
            raw = storage.read_all(self.path)
        except OSError as exc:
            raise SampleError(f"{self.path}: cannot open shard ({exc})", source=self.path) from exc
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            data = d.decompress(raw)
        except zlib.error as exc:
            raise SampleError(
                f"{self.path}: gzip stream is corrupt ({exc})", source=self.path
            ) from exc
        if not d.eof:
            self.truncated = True
            log.warning("%s: gzip stream ends early (truncated shard)", self.path)
        return data

    def _trailing_garbage(self, fh: io.BufferedIOBase, stop: int, end: int) -> bool:
        """True when non-zero bytes follow where tarfile stopped: a corrupt header, not the end."""
        fh.seek(stop)
        while True:
            chunk = fh.read(1 << 20)
            if not chunk:
                return False
            if chunk.count(0) != len(chunk):
                return True

    def _scan(self) -> None:
        """Read the tar headers once: key -> extension -> (offset, size).

        A shard cut short (truncated download) keeps the members that are complete; the last,
        incomplete one is left out and :attr:`truncated` is set, so reading that sample names it.
        """
        fh = self._open_stream()
        fh.seek(0)
        end = fh.seek(0, io.SEEK_END)
        fh.seek(0)
        last_key = None
        try:
            with tarfile.open(fileobj=fh, mode="r:") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    key, ext = split_member_name(info.name)
                    if not ext:
                        continue
                    last_key = key
                    if info.offset_data + info.size > end:
                        self.truncated = True
                        self.samples.setdefault(key, {})
                        break
                    self.samples.setdefault(key, {})[ext] = MemberRef(info.offset_data, info.size)
                stop = tar.offset
            if not self.truncated and self._trailing_garbage(fh, stop, end):
                # tarfile ends its iteration silently at a corrupt header: never lose data silently
                self.truncated = True
                log.error(
                    "%s: corrupt tar header at byte %d: samples after %r are unreadable",
                    self.path,
                    stop,
                    last_key,
                )
        except tarfile.ReadError as exc:
            if not self.samples:
                raise SampleError(
                    f"{self.path}: not a readable tar shard ({exc})", source=self.path
                ) from exc
            self.truncated = True
        if self.truncated:
            log.warning("%s: shard is truncated (last sample %r incomplete)", self.path, last_key)
            self._incomplete = last_key
            if last_key is not None:
                self.samples.setdefault(last_key, {})
        else:
            self._incomplete = None

    def keys(self) -> list[str]:
        """Sample keys in shard order."""
        return list(self.samples)

    def members(self, key: str) -> dict[str, MemberRef]:
        """Extensions of one sample and where their payloads lie."""
        try:
            return self.samples[key]
        except KeyError:
            raise SampleError(
                f"{self.path}: no sample with key {key!r} in this shard", source=self.path, key=key
            ) from None

    def read(
        self,
        member: str,
        exts: Sequence[str] | None = None,
        limit: int | Mapping[str, int] | None = None,
    ) -> dict[str, bytes]:
        """Payloads of sample ``member`` by extension (only ``exts`` when given).

        ``limit``: read at most this many bytes of each member, or of the members a mapping
        names (the index reads image headers). A sample's members lie side by side in the tar,
        so object storage serves them with one ranged GET (two when a ``limit`` leaves a gap
        over :data:`_GAP` bytes between them).
        """
        refs = self.members(member)
        if self.truncated and member == self._incomplete:
            raise SampleError(
                f"{self.path}: sample {member!r} is cut off (truncated or corrupt shard)",
                source=self.path,
                key=member,
            )
        spans = [
            (ext, ref.offset, ref.offset + min(ref.size, _limit(limit, ext, ref.size)))
            for ext, ref in refs.items()
            if exts is None or ext in exts
        ]
        try:
            if self.remote and not self._sequential and not _is_gzip_tar(self.path):
                out = _ranged_read(self.path, spans)
            else:
                out = {}
                with self._lock:
                    fh = self._open_stream()
                    for ext, start, end in spans:
                        fh.seek(start)
                        out[ext] = fh.read(end - start)
        except OSError as exc:
            raise SampleError(
                f"{self.path}: sample {member!r} unreadable ({type(exc).__name__}: {exc})",
                source=self.path,
                key=member,
            ) from exc
        for ext, start, end in spans:
            if len(out[ext]) != end - start:
                raise SampleError(
                    f"{self.path}: sample {member!r} member .{ext} is truncated "
                    f"({len(out[ext])} of {end - start} bytes)",
                    source=self.path,
                    key=member,
                )
        return out

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self._data = None


class TorchDatasetSource:
    """A user's map-style torch Dataset as a source: samples addressed by integer index.

    ``read(i)`` returns ``{"sample": dataset[i]}``; ``cost_fn(sample) -> SampleMeta-like sizes`` is
    the user's business (see :func:`entrain_data.workers.index_builder.index_torch_dataset`).
    Errors raised by the dataset become :class:`SampleError` naming the dataset and index.
    """

    def __init__(self, dataset: Any, name: str | None = None) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise InvalidInput(
                "TorchDatasetSource needs a map-style dataset (__getitem__ and __len__)"
            )
        self.dataset = dataset
        self.path = name or f"<{type(dataset).__name__}>"

    def __len__(self) -> int:
        return len(self.dataset)

    def keys(self) -> list[str]:
        return [str(i) for i in range(len(self.dataset))]

    def read(self, member: str | int, exts: Sequence[str] | None = None) -> dict[str, Any]:
        idx = int(member)
        try:
            return {"sample": self.dataset[idx]}
        except Exception as exc:
            raise SampleError(
                f"{self.path}: dataset[{idx}] failed ({type(exc).__name__}: {exc})",
                source=self.path,
                key=str(idx),
            ) from exc

    def close(self) -> None:
        pass


def parquet_metadata_files(
    sources: np.ndarray, members: np.ndarray, known: Collection[str] = ()
) -> frozenset[str]:
    """The Parquet files of an index that are metadata files (their rows name a record; a
    table's rows name none): ``--metadata records.parquet`` is no ``metadata.parquet``.
    ``known``: the index's distinct sources where it lists them (its identities): without a
    Parquet file among them no row is read (a 10M-row shard index: 0.6 s in every packer)."""
    if known and not any(str(s).endswith(PARQUET_SUFFIXES) for s in known):
        return frozenset()
    rows = np.flatnonzero(members.astype(bool))
    return frozenset(s for s in set(sources[rows].tolist()) if str(s).endswith(PARQUET_SUFFIXES))


def open_source(path: str | os.PathLike, **options: Any) -> Source:
    """Open a shard or table by suffix; raises InvalidInput for an unknown kind."""
    p = os.fspath(path)
    meta_columns = options.pop("metadata_columns", None)  # the index's mapping (metadata files)
    # metadata files named otherwise (``--metadata records.parquet``), as the index knows them
    named: Collection[str] = options.pop("metadata_files", ())
    from .metadata_source import MetadataSource, is_metadata_file

    if is_metadata_file(p) or p in named:
        return MetadataSource(p, meta_columns, lazy=True)
    if storage.is_dir(p):
        from .loose_files import DirectorySource

        return DirectorySource(p)
    if p.endswith(TAR_SUFFIXES + GZIP_TAR_SUFFIXES):
        return TarShard(p)
    if p.endswith(PARQUET_SUFFIXES):
        return ParquetSource(p, **options)
    raise InvalidInput(
        f"{p}: unknown source kind (expected .tar, .tgz, .tar.gz, .parquet or a folder)"
    )


class SourceCache:
    """One worker's open sources, opened on first use and kept (least recently used closed first).

    ``identities`` (the index's :attr:`~entrain_data.metadata.SampleTable.source_identity`): a
    source recorded there is checked against it when opened, one stat or HEAD per open, not per
    sample (:mod:`.source_identity`); one found changed is refused for the rest of the process.
    """

    def __init__(
        self,
        max_open: int = 64,
        opener: Callable[[str], Source] = open_source,
        identities: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.max_open = max_open
        self._opener = opener
        self._open: OrderedDict[str, Source] = OrderedDict()
        self._identities = dict(identities or {})
        self._changed: dict[str, str] = {}  # path -> why it is refused (no second HEAD)

    def _check(self, path: str) -> None:
        recorded = self._identities.get(path)
        if recorded is None:  # an index from before identities, or a folder: nothing to compare
            return
        if path not in self._changed:
            why, self._identities[path] = vouch(path, recorded)
            if why is None:
                return
            self._changed[path] = why
        raise SampleError(self._changed[path], source=path)

    def get(self, path: str) -> Source:
        src = self._open.get(path)
        if src is not None:
            self._open.move_to_end(path)
            return src
        self._check(path)
        src = self._opener(path)
        self._open[path] = src
        while len(self._open) > self.max_open:
            _, old = self._open.popitem(last=False)
            old.close()
        return src

    def read(self, path: str, member: str, exts: Sequence[str] | None = None) -> dict[str, Any]:
        return self.get(path).read(member, exts)

    def close(self) -> None:
        for src in self._open.values():
            src.close()
        self._open.clear()
