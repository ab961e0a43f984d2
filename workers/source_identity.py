"""Is a source file still the one that was indexed? One stat or one HEAD says, mostly.

The index holds positions: tar members by key, Parquet rows by number, metadata records by byte
offset. In a shard re-exported or an object overwritten after indexing, those positions read
another sample's bytes or garbage, silently. So indexing records what each file was
(:func:`probe_identity`: ``size`` + ``mtime_ns`` + ``head_tail`` for a local file; ``size`` + the
``etag`` and/or ``version`` / ``generation`` an object store reports) and a worker, when it opens a
source, compares (:func:`changed_since_indexing`): a file that changed is a :class:`SampleError`
naming it, the values indexed and the values now, handled by the service's ``on_error`` like any
unreadable sample.

What is compared: ``size`` always; then a witness of the content where both sides have one, else a
witness of the write: ``head_tail`` else ``mtime_ns`` (local), ``etag`` else ``version`` /
``generation`` (an overwrite with the very same bytes keeps its ETag but not its version). Fields
only one side has are not compared (an index built from a listing has no version; an HTTP server
may send no ETag; an index from before ``head_tail`` has none).

Local files: a matching ``mtime_ns`` is trusted without reading (one stat per open, as ever). A
different one is what a copy that did not keep modification times looks like (``cp -r``, ``scp``,
staging shards onto each node's NVMe), so the file is then read for :func:`content_fingerprint`
and accepted when it matches the one recorded: same bytes, other mtime.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from entrain_data.errors import SampleError

from . import storage

__all__ = [
    "probe_identity",
    "content_fingerprint",
    "identity_change",
    "changed_since_indexing",
    "vouch",
]

FINGERPRINT = "head_tail"
"""The identity field of :func:`content_fingerprint` (a new shape would take a new name)."""
FINGERPRINT_BLOCK = 1 << 16
"""Bytes hashed at each end of a file; a file of at most twice this is hashed whole."""

_FIELDS = ("size", "mtime_ns", FINGERPRINT, "etag", "version", "generation")
"""The fields compared, in the order a message names them."""


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


def content_fingerprint(path: str, size: int) -> str:
    """blake2b (16 bytes, hex) of ``size`` and the first and last :data:`FINGERPRINT_BLOCK` bytes
    of local ``path`` (the whole file up to twice that): at most 128 KiB read, whatever the size.

    The ends are where a rewrite shows: a tar's first member header (name, size, mtime), a
    Parquet footer (schema, row groups, offsets), a JSON array's brackets. No blocks sampled from
    the middle: a few fixed 64 KiB blocks cover a vanishing part of a large file (5 of a 1 GB
    JSONL: 0.03%), so they would not catch a same-size edit there, only cost reads. Such an edit
    either keeps every line's length (each offset still starts its record: the edited record is
    served) or moves a line start, and the record read at the old offset fails as a SampleError
    naming it. The fingerprint is only asked when the mtime changed too.
    """
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    with open(path, "rb") as f:
        if size <= 2 * FINGERPRINT_BLOCK:
            h.update(f.read())
        else:
            h.update(f.read(FINGERPRINT_BLOCK))
            f.seek(size - FINGERPRINT_BLOCK)
            h.update(f.read(FINGERPRINT_BLOCK))
    return h.hexdigest()


def probe_identity(path: str, *, fingerprint: bool = False) -> dict[str, int | str]:
    """What ``path`` is now, cheaply: one ``stat`` (local) or one HEAD (object storage);
    ``fingerprint`` (indexing) adds a local file's :func:`content_fingerprint`, a witness that
    survives a copy.

    Raises ``OSError`` (``FileNotFoundError`` for a missing file) naming ``path``.
    """
    if not storage.is_remote(path):
        st = os.stat(path)
        out: dict[str, int | str] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if fingerprint:
            out[FINGERPRINT] = content_fingerprint(path, st.st_size)
        return out
    return _remote_identity(storage.object_info(path))


def identity_change(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """None if ``now`` matches ``recorded``, else the fields compared as ``name old -> new``
    (``mtime_ns`` is shown beside a ``head_tail`` that decides, to say what happened)."""
    names = [n for n in _FIELDS if n in recorded and n in now]
    if "etag" in names:  # the ETag decides; a version says nothing of the content
        names = [n for n in names if n not in ("version", "generation")]
    decide = [n for n in names if n != "mtime_ns"] if FINGERPRINT in names else names
    if all(recorded[n] == now[n] for n in decide):
        return None
    return ", ".join(
        f"{n} {recorded[n]} -> {now[n]}" if recorded[n] != now[n] else f"{n} {now[n]} unchanged"
        for n in names
    )


def _unreachable(path: str, exc: OSError) -> SampleError | None:
    """None for a missing file (the opener's error already says so), else the SampleError."""
    if storage.failure_kind(exc) == "missing":
        return None
    return SampleError(f"{path}: cannot check it against the index ({exc})", source=path)


def changed_since_indexing(path: str, recorded: Mapping[str, Any]) -> str | None:
    """Why ``path`` is not the file indexed as ``recorded`` (the message of the SampleError its
    samples get), or None when it still is (see :func:`vouch`)."""
    return vouch(path, recorded)[0]


def vouch(path: str, recorded: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any]]:
    """(why ``path`` is not the file indexed as ``recorded``, or None; the identity to compare
    it with next time): a copy accepted by its fingerprint is ``recorded`` with the copy's
    mtime, so the next open of it is one stat again, not another 128 KiB read.

    Reads the file only when its size matches but its mtime does not and a fingerprint was
    recorded. A missing file is None too: the opener's error already says so. A probe that fails
    otherwise (refused, unreachable) raises :class:`SampleError`: the file cannot be vouched for
    this time.
    """
    try:
        now = probe_identity(path)
        change = identity_change(recorded, now)
        if (
            change is not None
            and FINGERPRINT in recorded
            and "mtime_ns" in now
            and recorded.get("size") == now.get("size")
        ):
            now[FINGERPRINT] = content_fingerprint(path, int(now["size"]))
            change = identity_change(recorded, now)
            if change is None:  # the same bytes under another mtime: that mtime vouches now
                return None, {**recorded, "mtime_ns": now["mtime_ns"]}
    except OSError as exc:
        err = _unreachable(path, exc)
        if err is None:
            return None, recorded
        raise err from exc
    if change is None:
        return None, recorded
    hint = ""
    if recorded.get("size") == now.get("size") and "mtime_ns" in now and FINGERPRINT not in now:
        hint = (
            " (a copy that did not keep modification times reads as changed too in an index"
            " from before content fingerprints; re-indexing records them)"
        )
    return f"{path}: changed since it was indexed ({change}): re-index{hint}", recorded
