"""Is a source file still the one that was indexed? One stat or one HEAD says.

The index holds positions: tar members by key, Parquet rows by number, metadata records by byte
offset. In a shard re-exported or an object overwritten after indexing, those positions read
another sample's bytes or garbage, silently. So indexing records what each file was
(:func:`probe_identity`: ``size`` + ``mtime_ns`` for a local file; ``size`` + the ``etag`` and/or
``version`` / ``generation`` an object store reports) and a worker, when it opens a source,
compares (:func:`changed_since_indexing`): a file that changed is a :class:`SampleError` naming
it, the values indexed and the values now, handled by the service's ``on_error`` like any
unreadable sample.

What is compared: ``size`` always; ``mtime_ns`` (local); ``etag`` where both sides have one, else
``version`` / ``generation`` (an overwrite with the very same bytes keeps its ETag but not its
version: the ETag is the better witness of content). Fields only one side has are not compared
(an index built from a listing has no version; an HTTP server may send no ETag).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from entrain_data.errors import SampleError

from . import storage

__all__ = ["probe_identity", "identity_change", "changed_since_indexing"]

_FALLBACK = ("version", "generation")
"""Compared only when either side lacks an ETag (see module doc)."""


def _remote_identity(info: Mapping[str, Any]) -> dict[str, int | str]:
    """The identity fields of an fsspec ``info()`` entry: s3fs (``ETag``, ``VersionId``), gcsfs
    (``etag``, ``generation``), adlfs (``etag``, ``version_id``), HTTP (``ETag``)."""
    out: dict[str, int | str] = {}
    if isinstance(info.get("size"), int):
        out["size"] = int(info["size"])
    etag = info.get("ETag") or info.get("etag")
    if etag:
        out["etag"] = str(etag).strip('"')
    version = info.get("VersionId") or info.get("version_id")
    if version:
        out["version"] = str(version)
    if info.get("generation"):
        out["generation"] = str(info["generation"])
    return out


def probe_identity(path: str) -> dict[str, int | str]:
    """What ``path`` is now, cheaply: one ``stat`` (local) or one HEAD (object storage).

    Raises ``OSError`` (``FileNotFoundError`` for a missing file) naming ``path``.
    """
    if not storage.is_remote(path):
        st = os.stat(path)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return _remote_identity(storage.object_info(path))


def identity_change(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """None if ``now`` matches ``recorded``, else the fields compared as ``name old -> new``."""
    names = ["size", "mtime_ns", "etag"]
    if not ("etag" in recorded and "etag" in now):
        names += _FALLBACK
    names = [n for n in names if n in recorded and n in now]
    if all(recorded[n] == now[n] for n in names):
        return None
    return ", ".join(
        f"{n} {recorded[n]} -> {now[n]}" if recorded[n] != now[n] else f"{n} {now[n]} unchanged"
        for n in names
    )


def changed_since_indexing(path: str, recorded: Mapping[str, Any]) -> str | None:
    """Why ``path`` is not the file indexed as ``recorded`` (the message of the SampleError its
    samples get), or None when it still is.

    A missing file is None too: the opener's error already says so. A probe that fails otherwise
    (refused, unreachable) raises :class:`SampleError`: the file cannot be vouched for this time.
    """
    try:
        now = probe_identity(path)
    except OSError as exc:
        if storage.failure_kind(exc) == "missing":
            return None
        raise SampleError(
            f"{path}: cannot check it against the index ({exc})", source=path
        ) from exc
    change = identity_change(recorded, now)
    if change is None:
        return None
    hint = ""
    if recorded.get("size") == now.get("size") and "mtime_ns" in now:
        hint = " (a copy that did not keep modification times reads as changed too)"
    return f"{path}: changed since it was indexed ({change}): re-index{hint}"
