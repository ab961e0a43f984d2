"""Sample metadata and the Parquet index that holds it.

Profiling, planning and assignment never decode payloads: they read this
metadata. It is kept at *item* granularity (every image, video clip and audio
clip with its own size) because one 4K page or long video can carry several
times a mean microbatch's work, and the encoder's share of it divides by item.

Sizes are stored in native units (pixels, frames, seconds), not in tokens: the
patch grid depends on the encoder (patch size, resize policy, merging), so the
cost model converts sizes to tokens for the encoder it is given.

In memory the index is a :class:`SampleTable`, a columnar struct of numpy arrays
with ragged item lists stored as offsets (the CSR layout Arrow uses), so a
65k-sample global batch is costed with vector operations.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import index_meta as imeta
from .errors import InvalidInput
from .index_paths import sources_for_index, sources_from_index

__all__ = [
    "INDEX_SCHEMA_VERSION",
    "INDEX_SCHEMA",
    "VisionItem",
    "SampleMeta",
    "SampleTable",
    "read_index",
    "write_index",
]

INDEX_SCHEMA_VERSION = 2
"""1: the columns below; 2: may also record each source file's identity (:mod:`.index_meta`)."""
_VERSION_KEY = b"entrain_data.index_schema_version"

INDEX_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("member", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("text_tokens", pa.int32(), nullable=False),
        pa.field("image_frames", pa.list_(pa.int32()), nullable=False),
        pa.field("image_height", pa.list_(pa.int32()), nullable=False),
        pa.field("image_width", pa.list_(pa.int32()), nullable=False),
        pa.field("audio_seconds", pa.list_(pa.float32()), nullable=False),
    ]
)
"""Columns of an index file.

``source`` is the shard or table path; ``member`` the WebDataset ``__key__``
inside a tar shard (empty for tables); ``row`` the row of a Parquet table (-1
for shards). ``image_*`` list one entry per vision item: a still image has
``frames == 1``, a video clip its sampled frame count. ``audio_seconds`` lists
one duration per audio clip.
"""


@dataclass(frozen=True)
class VisionItem:
    """One image (frames == 1) or video clip (frames > 1), in pixels."""

    frames: int
    height: int
    width: int

    def __post_init__(self) -> None:
        if self.frames < 1 or self.height < 1 or self.width < 1:
            raise InvalidInput(f"vision item sizes must be >= 1, got {self}")


@dataclass(frozen=True)
class SampleMeta:
    """Metadata of one sample: where it lives and the size of everything in it."""

    key: str
    source: str
    text_tokens: int
    images: tuple[VisionItem, ...] = ()
    audio_seconds: tuple[float, ...] = ()
    member: str = ""
    row: int = -1

    def __post_init__(self) -> None:
        if not self.key:
            raise InvalidInput("sample key must be a non-empty string")
        if self.text_tokens < 0:
            raise InvalidInput(
                f"sample {self.key!r}: text_tokens must be >= 0, got {self.text_tokens}"
            )
        for s in self.audio_seconds:
            if not (s >= 0.0) or not np.isfinite(s):
                raise InvalidInput(
                    f"sample {self.key!r}: audio_seconds must be finite and >= 0, got {s}"
                )


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _ragged_take(offsets: np.ndarray, values: Sequence[np.ndarray], idx: np.ndarray):
    """Gather the item lists of rows ``idx``; returns new offsets and value arrays."""
    counts = offsets[idx + 1] - offsets[idx]
    new_off = _offsets(counts)
    total = int(new_off[-1])
    if total == 0:
        return new_off, [v[:0].copy() for v in values]
    # position of every gathered item in the source arrays
    starts = np.repeat(offsets[idx], counts)
    within = np.arange(total, dtype=np.int64) - np.repeat(new_off[:-1], counts)
    src = starts + within
    return new_off, [v[src] for v in values]


@dataclass(frozen=True, eq=False)
class SampleTable:
    """Columnar sample metadata (one row per sample), the in-memory form of an index.

    Ragged item lists use offsets: the images of sample ``i`` are
    ``image_*[image_offsets[i]:image_offsets[i + 1]]``.
    """

    keys: np.ndarray  # object array of str, unique
    sources: np.ndarray  # object array of str
    members: np.ndarray  # object array of str
    rows: np.ndarray  # int64
    text_tokens: np.ndarray  # int64
    image_offsets: np.ndarray  # int64 [N + 1]
    image_frames: np.ndarray  # int32 [K]
    image_height: np.ndarray  # int32 [K]
    image_width: np.ndarray  # int32 [K]
    audio_offsets: np.ndarray  # int64 [N + 1]
    audio_seconds: np.ndarray  # float32 [A]
    origin: str = field(default="<memory>", compare=False)
    # role -> Parquet column given at index time (``text``, ``image``, ``audio`` ...): stored in
    # the index file's metadata so that ``serve`` reads the rows as they were indexed
    column_map: Mapping[str, str] = field(default_factory=dict, compare=False)
    # source -> what that file was when indexed (size, mtime_ns / etag ...): workers refuse a
    # file that changed since, whose members or rows no longer lie where the index says
    source_identity: Mapping[str, imeta.Identity] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        bad = [
            k for k, v in self.column_map.items() if not (isinstance(k, str) and isinstance(v, str))
        ]
        if bad:
            raise InvalidInput(f"{self.origin}: column_map entry {bad[0]!r} is not str -> str")
        object.__setattr__(self, "column_map", dict(self.column_map))
        ids = imeta.check_identities(self.source_identity, self.origin)
        object.__setattr__(self, "source_identity", ids)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise :class:`InvalidInput` naming the column or key of the first problem."""
        n = len(self.keys)
        where = self.origin
        for name in ("sources", "members", "rows", "text_tokens"):
            if len(getattr(self, name)) != n:
                raise InvalidInput(
                    f"{where}: column {name!r} has {len(getattr(self, name))} rows, expected {n}"
                )
        for off_name, cols in (
            ("image_offsets", ("image_frames", "image_height", "image_width")),
            ("audio_offsets", ("audio_seconds",)),
        ):
            off = getattr(self, off_name)
            if (
                len(off) != n + 1
                or (n >= 0 and len(off) and off[0] != 0)
                or np.any(np.diff(off) < 0)
            ):
                raise InvalidInput(f"{where}: {off_name} is not a valid offsets array for {n} rows")
            for c in cols:
                if len(getattr(self, c)) != int(off[-1]):
                    raise InvalidInput(f"{where}: column {c!r} length does not match {off_name}")
        if n:
            empty = np.flatnonzero(np.array([not isinstance(k, str) or not k for k in self.keys]))
            if len(empty):
                raise InvalidInput(
                    f"{where}: column 'key' has an empty or non-string key at row {int(empty[0])}"
                )
            uniq, counts = np.unique(self.keys.astype(str), return_counts=True)
            if np.any(counts > 1):
                dup = str(uniq[counts > 1][0])
                raise InvalidInput(
                    f"{where}: duplicate key {dup!r} in column 'key' ({int(counts[counts > 1][0])} rows)"
                )
        self._check_nonneg("text_tokens", self.text_tokens)
        for c in ("image_frames", "image_height", "image_width"):
            arr = getattr(self, c)
            bad = np.flatnonzero(arr < 1)
            if len(bad):
                row = int(np.searchsorted(self.image_offsets, bad[0], side="right") - 1)
                raise InvalidInput(
                    f"{where}: column {c!r} has a size < 1 ({int(arr[bad[0]])}) for key {self.keys[row]!r}"
                )
        a = self.audio_seconds
        bad = np.flatnonzero(~np.isfinite(a) | (a < 0))
        if len(bad):
            row = int(np.searchsorted(self.audio_offsets, bad[0], side="right") - 1)
            raise InvalidInput(
                f"{where}: column 'audio_seconds' has a negative or non-finite value ({float(a[bad[0]])}) "
                f"for key {self.keys[row]!r}"
            )

    def _check_nonneg(self, name: str, arr: np.ndarray) -> None:
        bad = np.flatnonzero(arr < 0)
        if len(bad):
            raise InvalidInput(
                f"{self.origin}: column {name!r} is negative ({int(arr[bad[0]])}) for key {self.keys[bad[0]]!r}"
            )

    # ------------------------------------------------------------ construction
    @classmethod
    def from_records(
        cls,
        records: Iterable[SampleMeta],
        origin: str = "<memory>",
        column_map: Mapping[str, str] | None = None,
        source_identity: Mapping[str, imeta.Identity] | None = None,
    ) -> SampleTable:
        """Build a table from :class:`SampleMeta` records (keeps their order)."""
        recs = list(records)
        img_counts = np.array([len(r.images) for r in recs], dtype=np.int64)
        aud_counts = np.array([len(r.audio_seconds) for r in recs], dtype=np.int64)
        imgs = [im for r in recs for im in r.images]
        return cls(
            keys=np.array([r.key for r in recs], dtype=object),
            sources=np.array([r.source for r in recs], dtype=object),
            members=np.array([r.member for r in recs], dtype=object),
            rows=np.array([r.row for r in recs], dtype=np.int64),
            text_tokens=np.array([r.text_tokens for r in recs], dtype=np.int64),
            image_offsets=_offsets(img_counts),
            image_frames=np.array([i.frames for i in imgs], dtype=np.int32),
            image_height=np.array([i.height for i in imgs], dtype=np.int32),
            image_width=np.array([i.width for i in imgs], dtype=np.int32),
            audio_offsets=_offsets(aud_counts),
            audio_seconds=np.array([s for r in recs for s in r.audio_seconds], dtype=np.float32),
            origin=origin,
            column_map=dict(column_map or {}),
            source_identity=dict(source_identity or {}),
        )

    @classmethod
    def from_arrow(cls, table: pa.Table, origin: str = "<arrow>") -> SampleTable:
        """Validate an Arrow table against :data:`INDEX_SCHEMA` and convert it."""
        missing = [f.name for f in INDEX_SCHEMA if f.name not in table.column_names]
        if missing:
            raise InvalidInput(
                f"{origin}: index is missing column(s) {', '.join(map(repr, missing))}"
            )
        cols: dict[str, pa.ChunkedArray] = {}
        for f in INDEX_SCHEMA:
            col = table.column(f.name)
            if col.null_count:
                raise InvalidInput(
                    f"{origin}: column {f.name!r} has {col.null_count} null value(s)"
                )
            if not col.type.equals(f.type):
                try:
                    col = col.cast(f.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                    raise InvalidInput(
                        f"{origin}: column {f.name!r} has type {col.type}, expected {f.type}"
                    ) from exc
            cols[f.name] = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col

        def flat(name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
            arr = cols[name]
            if arr.null_count or (len(arr) and arr.values.null_count):
                raise InvalidInput(f"{origin}: column {name!r} has null item(s)")
            offs = np.asarray(arr.offsets, dtype=np.int64)
            offs = offs - offs[0] if len(offs) else np.zeros(1, dtype=np.int64)
            vals = np.asarray(arr.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
            return offs, vals

        ioff, frames = flat("image_frames", np.int32)
        ioff_h, height = flat("image_height", np.int32)
        ioff_w, width = flat("image_width", np.int32)
        if not (np.array_equal(ioff, ioff_h) and np.array_equal(ioff, ioff_w)):
            raise InvalidInput(
                f"{origin}: columns 'image_frames', 'image_height' and 'image_width' list different item counts"
            )
        aoff, secs = flat("audio_seconds", np.float32)
        column_map = imeta.read_column_map(table.schema.metadata or {}, origin)
        return cls(
            keys=np.array(cols["key"].to_pylist(), dtype=object),
            sources=np.array(cols["source"].to_pylist(), dtype=object),
            members=np.array(cols["member"].to_pylist(), dtype=object),
            rows=cols["row"].to_numpy().astype(np.int64),
            text_tokens=cols["text_tokens"].to_numpy().astype(np.int64),
            image_offsets=ioff,
            image_frames=frames,
            image_height=height,
            image_width=width,
            audio_offsets=aoff,
            audio_seconds=secs,
            origin=origin,
            column_map=column_map,
            source_identity=imeta.read_identities(table.schema.metadata or {}, origin),
        )

    def to_arrow(self) -> pa.Table:
        """The table in :data:`INDEX_SCHEMA`, with the schema version in its metadata."""

        def lst(off: np.ndarray, vals: np.ndarray, typ: pa.DataType) -> pa.Array:
            return pa.ListArray.from_arrays(
                pa.array(off.astype(np.int32)), pa.array(vals, type=typ)
            )

        arrays = [
            pa.array(self.keys.tolist(), type=pa.string()),
            pa.array(self.sources.tolist(), type=pa.string()),
            pa.array(self.members.tolist(), type=pa.string()),
            pa.array(self.rows, type=pa.int64()),
            pa.array(self.text_tokens.astype(np.int32), type=pa.int32()),
            lst(self.image_offsets, self.image_frames, pa.int32()),
            lst(self.image_offsets, self.image_height, pa.int32()),
            lst(self.image_offsets, self.image_width, pa.int32()),
            lst(self.audio_offsets, self.audio_seconds, pa.float32()),
        ]
        meta = {_VERSION_KEY: str(INDEX_SCHEMA_VERSION).encode()}
        if self.column_map:
            meta[imeta.COLUMNS_KEY] = json.dumps(self.column_map, sort_keys=True).encode()
        if self.source_identity:
            meta[imeta.IDENTITY_KEY] = json.dumps(self.source_identity, sort_keys=True).encode()
        schema = INDEX_SCHEMA.with_metadata(meta)
        return pa.Table.from_arrays(arrays, schema=schema)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.keys)

    @property
    def image_counts(self) -> np.ndarray:
        """Number of vision items of every sample."""
        return np.diff(self.image_offsets)

    @property
    def audio_counts(self) -> np.ndarray:
        """Number of audio clips of every sample."""
        return np.diff(self.audio_offsets)

    def image_sample_ids(self) -> np.ndarray:
        """For every vision item, the row of the sample that owns it."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.image_counts)

    def audio_sample_ids(self) -> np.ndarray:
        """For every audio clip, the row of the sample that owns it."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.audio_counts)

    def take(self, indices: Sequence[int] | np.ndarray) -> SampleTable:
        """Rows ``indices`` in that order (a global batch, a shard's samples ...)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise InvalidInput("take: indices must be one-dimensional")
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise InvalidInput(f"take: index out of range for a table of {len(self)} samples")
        ioff, (fr, h, w) = _ragged_take(
            self.image_offsets, (self.image_frames, self.image_height, self.image_width), idx
        )
        aoff, (secs,) = _ragged_take(self.audio_offsets, (self.audio_seconds,), idx)
        return SampleTable(
            keys=self.keys[idx],
            sources=self.sources[idx],
            members=self.members[idx],
            rows=self.rows[idx],
            text_tokens=self.text_tokens[idx],
            image_offsets=ioff,
            image_frames=fr,
            image_height=h,
            image_width=w,
            audio_offsets=aoff,
            audio_seconds=secs,
            origin=self.origin,
            column_map=self.column_map,
            source_identity=self.source_identity,
        )

    def record(self, i: int) -> SampleMeta:
        """Row ``i`` as a :class:`SampleMeta`."""
        a, b = int(self.image_offsets[i]), int(self.image_offsets[i + 1])
        c, d = int(self.audio_offsets[i]), int(self.audio_offsets[i + 1])
        return SampleMeta(
            key=str(self.keys[i]),
            source=str(self.sources[i]),
            member=str(self.members[i]),
            row=int(self.rows[i]),
            text_tokens=int(self.text_tokens[i]),
            images=tuple(
                VisionItem(int(f), int(h), int(w))
                for f, h, w in zip(
                    self.image_frames[a:b], self.image_height[a:b], self.image_width[a:b]
                )
            ),
            audio_seconds=tuple(float(s) for s in self.audio_seconds[c:d]),
        )

    def __iter__(self) -> Iterator[SampleMeta]:
        for i in range(len(self)):
            yield self.record(i)

    @staticmethod
    def concat(tables: Sequence[SampleTable]) -> SampleTable:
        """Rows of all ``tables`` in order (keys must stay unique)."""
        if not tables:
            return SampleTable.from_records([])

        def cat_off(name: str) -> np.ndarray:
            parts, base = [np.zeros(1, dtype=np.int64)], 0
            for t in tables:
                off = getattr(t, name)
                parts.append(off[1:] + base)
                base += int(off[-1])
            return np.concatenate(parts)

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(t, name) for t in tables])

        return SampleTable(
            keys=cat("keys"),
            sources=cat("sources"),
            members=cat("members"),
            rows=cat("rows"),
            text_tokens=cat("text_tokens"),
            image_offsets=cat_off("image_offsets"),
            image_frames=cat("image_frames"),
            image_height=cat("image_height"),
            image_width=cat("image_width"),
            audio_offsets=cat_off("audio_offsets"),
            audio_seconds=cat("audio_seconds"),
            origin="+".join(sorted({t.origin for t in tables})),
            column_map=imeta.merged_column_maps((t.origin, t.column_map) for t in tables),
            source_identity=imeta.merged_identities((t.origin, t.source_identity) for t in tables),
        )


def write_index(table: SampleTable, path: str | Path) -> Path:
    """Write ``table`` as a Parquet index (atomically: temp file, then rename; the temp file
    removed on any failure, so a failed write leaves nothing behind)."""
    path = Path(path)
    if path.is_dir():  # the rename would fail after the whole write
        raise InvalidInput(f"index {path}: is a folder, give a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    where = str(path.parent.resolve())
    table = replace(
        table,
        sources=sources_for_index(table.sources, where),
        source_identity=imeta.remap_identities(table.source_identity, sources_for_index, where),
    )
    try:
        pq.write_table(table.to_arrow(), tmp, compression="zstd")
        tmp.replace(path)
    except BaseException:  # a full disk, Ctrl-C, a folder made meanwhile
        with contextlib.suppress(OSError):  # the first error is the one to say
            tmp.unlink(missing_ok=True)
        raise
    return path


def read_index(path: str | Path) -> SampleTable:
    """Read and validate a Parquet index; errors name the file and the column or key."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"index file not found: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidInput(f"{path}: not a readable Parquet index ({exc})") from exc
    meta = table.schema.metadata or {}
    version = meta.get(_VERSION_KEY)
    if version is not None and int(version) > INDEX_SCHEMA_VERSION:
        raise InvalidInput(
            f"{path}: index schema version {int(version)} is newer than this package's ({INDEX_SCHEMA_VERSION})"
        )
    out = SampleTable.from_arrow(table, origin=str(path))
    where = str(path.parent.resolve())
    return replace(
        out,
        sources=sources_from_index(out.sources, where),
        source_identity=imeta.remap_identities(out.source_identity, sources_from_index, where),
    )
