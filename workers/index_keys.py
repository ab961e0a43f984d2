"""Sample keys unique across an index: the user's kept as given, the index's own made unique.

Keys a mapped ``key`` column or field gives are the user's: served keys and skip lists name
them, so a repeat is refused naming both records (:func:`claim`), never renamed. Keys the index
makes (shard member keys, ``<table>:<row>``, ``<metadata file>:<line>``) repeated across files
take the file's name, or its path below the folder common to them, as a prefix
(:func:`unique_keys`); a made key that still equals another record's (a user key spelt like
it) is refused naming both records, not left to the table's check, which can only count them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from entrain_data.errors import InvalidInput
from entrain_data.metadata import SampleMeta

from .metadata_source import is_metadata_file, member_line

__all__ = ["Claimed", "claim", "unique_keys"]

Claimed = dict[str, tuple[str, str]]
"""User keys seen so far: key -> (source, where its record is), to name both of a repeat."""

log = logging.getLogger(__name__)


def claim(seen: Claimed, key: str, source: str, where: str, column: str) -> None:
    """A key from the user's key column, once: renamed to stay unique, it would no longer be
    the user's key (served keys, skip lists), so a repeat is refused naming both records."""
    first = seen.setdefault(key, (source, where))
    if first != (source, where):
        raise InvalidInput(
            f"duplicate key {key!r} in column {column!r}: {first[1]} and {where} (keys must be "
            "unique: drop or rename the repeats, or map no key column: keys are then the file's "
            "name and line or row)"
        )


def unique_keys(
    records: list[SampleMeta], fixed: set[tuple[str, str]] | frozenset = frozenset()
) -> list[SampleMeta]:
    """Keys unique across files (module doc). A shard's member keys repeated in another shard
    take ``<shard name>:``, or the shard's path below the folder common to all of them where
    names repeat too (``a/000.tar``, ``b/000.tar``). Keys the index made from a file's name
    (``<table>:<row>``, ``<metadata file>:<line>``) take that path only where they repeat
    (``en/train-0.parquet:3``, ``a/metadata.jsonl:1``), so a rebuild of any other index keeps
    its keys (and data fingerprint). ``fixed``: (source, key) of user keys, never renamed."""
    keys = [r.key for r in records]
    if len(set(keys)) == len(keys):
        return records

    def made(r: SampleMeta) -> str | None:
        """The row or line a key the index made from its file's name ends with, else None."""
        base = os.path.basename(r.source) + ":"
        if (r.source, r.key) in fixed or r.key == r.member or not r.key.startswith(base):
            return None
        return r.key[len(base) :]

    tails = [r.key for r in records if made(r) is not None]
    made_collide = len(set(tails)) < len(tails)

    def own(r: SampleMeta) -> str | None:
        """The part of its key a record keeps under a prefix (None: no prefix)."""
        if r.member and r.key == r.member and (r.source, r.key) not in fixed:
            return r.member  # a shard's member key
        return made(r) if made_collide else None

    def prefixed(name) -> list[SampleMeta]:
        return [
            replace(r, key=f"{name(r.source)}:{tail}") if (tail := own(r)) is not None else r
            for r in records
        ]

    out = prefixed(os.path.basename)
    if len({r.key for r in out}) < len(out):

        def where(p: str) -> str:  # object storage: the path inside the bucket's URL
            return p.split("://", 1)[1] if "://" in p else os.path.abspath(p)

        try:
            root = os.path.commonpath([where(r.source) for r in records if own(r) is not None])
            out = prefixed(lambda p: os.path.relpath(where(p), root))
        except ValueError:  # local paths beside URLs: no common folder
            out = prefixed(where)
    log.info("sample keys repeat across files: keys take their file's name or path as prefix")
    _refuse_repeats(out)
    return out


def _refuse_repeats(records: list[SampleMeta]) -> None:
    """InvalidInput naming both records of the first key still repeated after the prefixes (a
    made key equal to a user's: ``t.parquet:1`` given beside a null key the index reads as it)."""
    first: dict[str, SampleMeta] = {}
    for r in records:
        if (a := first.setdefault(r.key, r)) is not r:
            raise InvalidInput(
                f"duplicate key {r.key!r}: {_where(a)} and {_where(r)} (keys must be unique; a "
                "key given in the key column may equal one the index makes for a record without "
                "one: rename it, or give every record a key)"
            )


def _where(r: SampleMeta) -> str:
    """Where a record is, as a reader finds it: a table's row, a metadata file's line, a
    shard's member."""
    if r.row >= 0:
        return f"{r.source} row {r.row}"
    if is_metadata_file(r.source):
        try:
            line = member_line(r.member)
        except ValueError:
            line = None
        if line is not None:
            return f"{r.source}:{line}"
        record = r.member.partition("#")[0]
        if record.isdigit():  # a CSV record: no line in its member
            return f"{r.source} record {int(record) + 1}"
    return f"{r.source} member {r.member!r}"
