"""What an index file keeps in its Parquet schema metadata besides the schema version.

Two entries, both JSON, both optional (an index without them is read as before):

- ``entrain_data.column_map``: role -> Parquet column given at index time, so ``serve`` reads the
  rows as they were indexed;
- ``entrain_data.source_identity`` (schema version 2): source -> what the file was when it was
  indexed (``size``, ``mtime_ns`` and ``head_tail``, a hash of its ends, for a local file;
  ``size`` and the ``etag`` and/or ``version`` / ``generation`` the object store reported).
  Workers compare it with the file they open: the index holds positions (tar members, Parquet
  rows) that are only valid in the file they were read from.

  ``head_tail`` came without a version bump: it is optional, readers compare only the fields
  they know (an older package checks such an index by mtime as before; a bump would make it
  refuse the index outright), and an index without it is checked by mtime.

Kept apart from :mod:`.metadata` so that module stays about the columns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from .errors import InvalidInput

__all__ = [
    "COLUMNS_KEY",
    "IDENTITY_KEY",
    "Identity",
    "read_column_map",
    "merged_column_maps",
    "read_identities",
    "check_identities",
    "merged_identities",
    "remap_identities",
]

COLUMNS_KEY = b"entrain_data.column_map"
IDENTITY_KEY = b"entrain_data.source_identity"

Identity = Mapping[str, int | str]
"""One source's identity fields (``size``, ``mtime_ns``, ``head_tail``, ``etag``, ``version``,
``generation``); unknown ones are kept and not compared."""


def _json(meta: Mapping[bytes, bytes], key: bytes, what: str, origin: str) -> object:
    raw = meta.get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{origin}: {what} in the index metadata is not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise InvalidInput(f"{origin}: {what} in the index metadata is not an object")
    return value


def read_column_map(meta: Mapping[bytes, bytes], origin: str) -> dict[str, str]:
    """The stored column map, or ``{}`` for an index written without one."""
    return _json(meta, COLUMNS_KEY, "column map", origin) or {}  # type: ignore[return-value]


def merged_column_maps(maps: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """One map for a concatenation of ``(origin, map)``; one role mapped two ways clashes."""
    out: dict[str, str] = {}
    for origin, cmap in maps:
        for role, col in cmap.items():
            if out.setdefault(role, col) != col:
                raise InvalidInput(
                    f"concat: {origin} maps {role!r} to column {col!r}, another table to {out[role]!r}"
                )
    return out


def check_identities(ids: Mapping[str, Mapping[str, object]], origin: str) -> dict[str, dict]:
    """``ids`` as plain dicts, or InvalidInput naming the first source with a malformed entry."""
    out: dict[str, dict] = {}
    for src, ident in ids.items():
        ok = isinstance(src, str) and isinstance(ident, Mapping)
        ok = ok and all(
            isinstance(k, str) and isinstance(v, (int, str)) and not isinstance(v, bool)
            for k, v in ident.items()
        )
        if not ok:
            raise InvalidInput(f"{origin}: source identity of {src!r} is malformed: {ident!r}")
        out[src] = dict(ident)
    return out


def read_identities(meta: Mapping[bytes, bytes], origin: str) -> dict[str, dict]:
    """The stored source identities, or ``{}`` (an index from before they were recorded)."""
    ids = _json(meta, IDENTITY_KEY, "source identity", origin) or {}
    return check_identities(ids, origin)  # type: ignore[arg-type]


def merged_identities(tables: Iterable[tuple[str, Mapping[str, Identity]]]) -> dict[str, dict]:
    """One map for a concatenation; a source indexed twice as two different files clashes."""
    out: dict[str, dict] = {}
    for origin, ids in tables:
        for src, ident in ids.items():
            if out.setdefault(src, dict(ident)) != dict(ident):
                raise InvalidInput(
                    f"concat: {origin} indexed {src} as {dict(ident)}, another table as "
                    f"{out[src]}: re-index them together"
                )
    return out


def remap_identities(
    ids: Mapping[str, Identity], rewrite: Callable[[np.ndarray, str], np.ndarray], where: str
) -> dict[str, dict]:
    """``ids`` keyed by the sources as ``rewrite`` (the index's path rewriting) turns them."""
    if not ids:
        return {}
    names = rewrite(np.array(list(ids), dtype=object), where)
    return {str(n): dict(v) for n, v in zip(names, ids.values())}
