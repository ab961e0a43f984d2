"""Parquet tables as a source: row access through row groups, rows as WebDataset-style members.

Split from :mod:`.sources` (which re-exports both names). A table may live in object storage
(:mod:`.storage`): the footer and then only the column chunks of the row group asked for are read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from entrain_data.errors import SampleError

from . import storage

__all__ = ["ParquetSource", "row_members"]


def row_members(values: dict[str, Any], columns: dict[str, str]) -> dict[str, bytes]:
    """A Parquet row as WebDataset-style members, so the same decode path serves both.

    ``columns`` maps roles to column names: ``text`` (a string -> ``txt``; a list or dict, a
    conversation -> ``json``), ``image`` (bytes or a list of bytes -> ``image000.png``... the
    decoders sniff the real format), ``audio`` (same -> ``audio000.wav``...).
    """
    import json

    out: dict[str, bytes] = {}
    if "text" in columns:
        v = values.get(columns["text"])
        if isinstance(v, str):
            out["txt"] = v.encode("utf-8")
        elif v is not None:
            out["json"] = json.dumps(v).encode("utf-8")
    for role, name in (("image", "image{:03d}.png"), ("audio", "audio{:03d}.wav")):
        if role not in columns:
            continue
        v = values.get(columns[role])
        items = v if isinstance(v, (list, tuple)) else ([] if v is None else [v])
        for i, item in enumerate(items):
            if isinstance(item, dict):  # Hugging Face datasets store {"bytes": ..., "path": ...}
                item = item.get("bytes")
            if not isinstance(item, (bytes, bytearray)):
                raise SampleError(f"column {columns[role]!r} item {i} is not bytes")
            out[name.format(i)] = bytes(item)
    return out


class ParquetSource:
    """Row access into a Parquet table through its row groups (one row group decoded per miss).

    ``member`` is the row number as a string (``"17"``) or an int; ``read`` returns the row's
    columns as Python values (``bytes`` for binary columns).
    """

    def __init__(self, path: str | os.PathLike, columns: Sequence[str] | None = None) -> None:
        self.path = os.fspath(path)
        try:
            self._file = storage.open_parquet(self.path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SampleError(
                f"{self.path}: not a readable Parquet table ({exc})", source=self.path
            ) from exc
        meta = self._file.metadata
        self.num_rows = meta.num_rows
        self._starts = [0]
        for g in range(meta.num_row_groups):
            self._starts.append(self._starts[-1] + meta.row_group(g).num_rows)
        self.columns = list(columns) if columns is not None else None
        self._cached: tuple[tuple[int, tuple[str, ...] | None], pa.Table] | None = None
        """The last row group decoded, keyed by (group, columns read): a read asking for other
        columns must not be served the narrower table."""

    def keys(self) -> list[str]:
        return [str(i) for i in range(self.num_rows)]

    def _group(self, row: int) -> tuple[int, int]:
        import bisect

        g = bisect.bisect_right(self._starts, row) - 1
        return g, row - self._starts[g]

    def read(self, member: str | int, exts: Sequence[str] | None = None) -> dict[str, Any]:
        try:
            row = int(member)
        except (TypeError, ValueError):
            raise SampleError(
                f"{self.path}: row {member!r} is not an integer", source=self.path, key=str(member)
            ) from None
        if not 0 <= row < self.num_rows:
            raise SampleError(
                f"{self.path}: row {row} out of range ({self.num_rows} rows)",
                source=self.path,
                key=str(row),
            )
        g, within = self._group(row)
        cols = list(exts) if exts is not None else self.columns
        cache_key = (g, None if cols is None else tuple(cols))
        if self._cached is None or self._cached[0] != cache_key:
            try:
                self._cached = (cache_key, self._file.read_row_group(g, columns=cols))
            except (pa.ArrowInvalid, OSError, KeyError) as exc:  # storage raises only OSError
                raise SampleError(
                    f"{self.path}: row {row} (row group {g}) unreadable ({exc})",
                    source=self.path,
                    key=str(row),
                ) from exc
        table = self._cached[1]
        names = [c for c in table.column_names if exts is None or c in exts]
        return {c: table.column(c)[within].as_py() for c in names}

    def close(self) -> None:
        self._cached = None
        self._file.close()
