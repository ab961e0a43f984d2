"""Input patterns to the sources an index reads: braces, globs, object-storage prefixes, paths.

``expand_paths`` gives remote inputs the behaviour local ones have: a brace pattern expands in
place (``shard-{000..099}.tar``); a glob (``*``, ``?``, ``[...]``, ``**``) expands to the *files*
it matches, sorted, local and remote alike; where it matches folders (prefixes) too, its files
are read, not the folders (``data/**`` matches ``data``, ``data/sub`` and ``data/sub/0.tar``:
each folder would index ``0.tar`` again), with a warning naming them, unless none of its files
is a shard, a table or a metadata file (a README beside the folders): the folders are read
then. A glob that matches only folders or prefixes (``data/part-*``) stands for them, each as
if named, the outermost only (a folder is read with what is under it). A folder or prefix is one source where an input names it, local folder and object-storage
prefix (``s3://bucket/ds/``, or a key that is only a prefix) alike: read through the metadata
file ``metadata`` names inside it (the CLI's ``--metadata``: one HEAD, no listing), else
through its top-level ``metadata.jsonl`` / ``.csv`` / ``.parquet``, else as the shards and
tables under it (a prefix, or a local folder without loose media files) or its loose files (a
local folder, :func:`_local_shards`). A path named twice (however
spelled: relative, absolute, through ``./``) is one input, at its first place.

Object storage charges a round trip per request: what a listing returned is not asked about
again, and explicit remote paths are checked with :data:`CHECK_THREADS` HEADs in flight, not one
after another. ``http(s)://`` URLs are never listed (no listing API; ``?`` starts a query).
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from entrain_data.errors import InvalidInput

from . import storage

__all__ = ["CHECK_THREADS", "MAX_NAMED", "expand_braces", "expand_paths"]

log = logging.getLogger(__name__)

CHECK_THREADS = 16
"""HEAD requests in flight while explicit remote paths are checked: each costs tens of ms before
its answer, so thousands of shards one by one take minutes; 16 at once stay far below a bucket's
request-rate limits (S3: 5,500 GET/HEAD a second per prefix)."""

MAX_NAMED = 10
"""Missing inputs one error names (then how many more): a brace pattern over a wrong folder
misses thousands, and the message is one line."""

_BRACE = re.compile(r"\{([^{}]*)\}")
_MAGIC = re.compile(r"[*?\[]")


class _Missing(InvalidInput):
    """An input that names nothing to index (a missing path, an empty prefix, an unmatched glob):
    gathered, so one error names every such input; a storage failure (credentials, endpoint)
    concerns them all and is raised at once."""


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{a,b}`` alternatives and ``{000..099}`` ranges (zero padding kept), left to right.

    Our own small expansion (webdataset's ``braceexpand`` is an optional dependency); nested
    braces are expanded from the innermost outwards.
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    rng = re.fullmatch(r"(-?\d+)\.\.(-?\d+)(?:\.\.(\d+))?", body)
    if rng:
        lo, hi = int(rng.group(1)), int(rng.group(2))
        step = int(rng.group(3) or 1) * (1 if hi >= lo else -1)
        width = len(rng.group(1)) if rng.group(1).lstrip("-").startswith("0") else 0
        parts = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    else:
        parts = body.split(",")
    out: list[str] = []
    for p in parts:
        out.extend(expand_braces(pattern[: m.start()] + p + pattern[m.end() :]))
    return out


def _under_prefix(prefix: str, pat: str) -> list[str]:
    """What a prefix stands for (module doc), from one listing; hidden names (``.x``) passed over
    as in a local folder. Nothing to index there is an error naming the prefix."""
    from .metadata_source import METADATA_NAMES, is_metadata_file
    from .sources import GZIP_TAR_SUFFIXES, PARQUET_SUFFIXES, TAR_SUFFIXES

    base = prefix.rstrip("/") + "/"
    visible = []
    for url in storage.list_objects(base):
        rel = url[len(base) :] if url.startswith(base) else url.rsplit("/", 1)[-1]
        if not any(part.startswith(".") for part in rel.split("/")):
            visible.append(url)
    if not visible:
        raise _Missing(f"no objects under {base} (from pattern {pat!r})")
    for name in METADATA_NAMES:
        if base + name in visible:
            return [base + name]
    kinds = TAR_SUFFIXES + GZIP_TAR_SUFFIXES + PARQUET_SUFFIXES
    found = [u for u in visible if u.endswith(kinds) and not is_metadata_file(u)]
    if not found:
        metas = [u for u in visible if is_metadata_file(u)]
        hint = f"; to index through a metadata file, name it: {metas[0]}" if metas else ""
        n = len(visible)
        raise _Missing(
            f"no shard ({', '.join(TAR_SUFFIXES + GZIP_TAR_SUFFIXES)}) or table "
            f"({', '.join(PARQUET_SUFFIXES)}) under {base}, only {n} other object{'s' * (n > 1)} "
            f"such as {visible[0]} (from pattern {pat!r}){hint}"
        )
    if len(found) < len(visible):
        log.info(
            "%s: %d objects passed over (not shards or tables)", base, len(visible) - len(found)
        )
    return found


def _shown(url: str, p: str) -> bool:
    """Whether a shell's glob ``p`` would match ``url``: a wildcard never matches a leading dot,
    only a component of the pattern that spells it does, and ``**`` passes hidden folders over
    (fsspec matches them all)."""
    parts, pats = url.split("/"), p.split("/")
    if "**" in pats:
        head = pats[: pats.index("**")]
        tail = pats[len(pats) - pats[::-1].index("**") :]
        pairs = [*zip(head, parts), *zip(reversed(tail), reversed(parts))]
        middle = parts[len(head) : len(parts) - len(tail)]
    else:
        pairs, middle = list(zip(pats, parts)), []
    return not any(q.startswith(".") for q in middle) and all(
        x.startswith(".") or not q.startswith(".") for x, q in pairs
    )


def _matches(p: str, pat: str, metadata: str | None) -> list[str]:
    """A glob's file matches, sorted; hidden names only where the pattern spells the dot, as a
    shell. A glob matching only folders (prefixes) stands for them, each as :func:`_folder`
    reads it. A path that exists as written (a name with ``[`` in it) is itself when nothing
    matches."""
    if storage.is_remote(p):
        found = [u for u in storage.glob_objects(p) if _shown(u, p)]
        # the prefixes only where no shard, table or metadata file matched: a listing more
        prefixes = [] if any(map(_a_source, found)) else storage.glob_objects(p, "directory")
        folders = [u for u in prefixes if _shown(u, p)]
    else:
        hits = sorted(glob.glob(p, recursive=True))
        found = [m for m in hits if os.path.isfile(m)]
        folders = [m.rstrip("/") or "/" for m in hits if os.path.isdir(m)]
    if folders and found:  # a shard beside folders wins; a README beside them does not
        if not any(map(_a_source, found)):
            log.warning("%s: indexing its folders, passing over the files %s", p, _some(found))
            found = []
        elif not metadata:
            log.warning(
                "%s matches files and folders: indexing its %d files, not the folders (%s); "
                "name a folder to index it as one source",
                p,
                len(found),
                _some(folders),
            )
    if folders and not found:  # data/part-*: the folders, as if each were named
        return [f for d in _outermost(folders) for f in _folder(d, pat, metadata)]
    if found and metadata:
        raise _not_a_folder(f"{p} is a glob, which yields files", pat, metadata)
    if found:
        return found
    kind = storage.path_kind(p)
    if kind is None:
        raise _Missing(f"nothing matches {p} (from pattern {pat!r})")
    return _resolved(p, pat, kind, metadata)


def _a_source(path: str) -> bool:
    """Whether a file is a shard, a table or a metadata file by its name."""
    from .metadata_source import is_metadata_file
    from .sources import GZIP_TAR_SUFFIXES, PARQUET_SUFFIXES, TAR_SUFFIXES

    return path.endswith(TAR_SUFFIXES + GZIP_TAR_SUFFIXES + PARQUET_SUFFIXES) or is_metadata_file(
        path
    )


def _outermost(folders: list[str]) -> list[str]:
    """``folders`` (sorted) without those inside another of them: a folder is read with
    everything under it, so ``data/**/`` would index ``data/a``'s samples twice."""
    out: list[str] = []
    for d in folders:
        if not any(d.startswith(o.rstrip("/") + "/") for o in out):
            out.append(d)
    return out


def _some(names: list[str], most: int = 3) -> str:
    """The first few of ``names`` for a message: a glob may match thousands."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _not_a_folder(what: str, pat: str, metadata: str) -> InvalidInput:
    return InvalidInput(
        f"--metadata {metadata} names a file inside each folder or prefix given; {what} (from "
        f"pattern {pat!r}): name the folders, or give metadata files without --metadata"
    )


def _folder(p: str, pat: str, metadata: str | None) -> list[str]:
    """What a folder or prefix an input names stands for (module doc)."""
    from .metadata_source import METADATA_NAMES

    if metadata:
        if os.path.isabs(metadata) or storage.is_remote(metadata):
            path = metadata  # one file for every folder given
        elif storage.is_remote(p):
            path = p.rstrip("/") + "/" + metadata
        else:
            path = os.path.join(p, metadata)
        if storage.path_kind(path) != "file":
            raise _Missing(f"metadata file not found: {path} (from pattern {pat!r})")
        return [path]
    if storage.is_remote(p):
        return _under_prefix(p, pat)
    folder = p.rstrip("/") or "/"
    for name in METADATA_NAMES:
        if os.path.isfile(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    return _local_shards(folder) or [folder]


def _local_shards(folder: str) -> list[str]:
    """The shards and tables under a local folder without loose media, sorted, as a prefix's
    listing gives them (metadata files beside them passed over, as there); [] where the folder
    holds loose media (read as its loose files: the walk stops at the first) or nothing to read."""
    from .decode import member_kind
    from .metadata_source import is_metadata_file
    from .sources import split_member_name

    found: list[str] = []
    for top, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            if member_kind(split_member_name(name)[1]) in ("image", "audio", "video"):
                if found:
                    log.warning(
                        "%s: indexing its loose files, passing over the shards or tables "
                        "beside them (%s); name those to index them",
                        folder,
                        _some(found),
                    )
                return []
            if _a_source(name) and not is_metadata_file(name):
                found.append(os.path.join(top, name))
    if found:
        log.info(
            "%s: no loose media; indexing the %d shards and tables under it", folder, len(found)
        )
    return sorted(found)


def _resolved(p: str, pat: str, kind: str | None | InvalidInput, metadata: str | None) -> list[str]:
    """A checked path: a file is itself, a folder or prefix what :func:`_folder` says."""
    if isinstance(kind, InvalidInput):
        raise kind
    if kind == "file" and metadata:
        raise _not_a_folder(f"{p} is a file", pat, metadata)
    if kind == "file":
        return [p]
    if kind == "directory":
        return _folder(p, pat, metadata)
    raise _Missing(f"shard, table or folder not found: {p} (from pattern {pat!r})")


def _kind_or_error(path: str) -> str | None | InvalidInput:
    try:
        return storage.path_kind(path)
    except InvalidInput as exc:
        return exc  # raised in input order, so the error names the first bad path


def _kinds(paths: list[str]) -> list[str | None | InvalidInput]:
    """:func:`storage.path_kind` of each remote path, :data:`CHECK_THREADS` in flight. The first
    on this thread: a refused credential fails after one request, not thousands, and the
    backend's client is made once, not raced for."""
    if not paths:
        return []
    first = storage.path_kind(paths[0])
    if len(paths) == 1:
        return [first]
    with ThreadPoolExecutor(min(CHECK_THREADS, len(paths) - 1), "entrain-check") as pool:
        return [first, *pool.map(_kind_or_error, paths[1:])]


def _expand(p: str, pat: str, metadata: str | None) -> list[str] | None:
    """What one path of a pattern stands for; None for a named remote path, checked later with
    the others (:func:`_kinds`)."""
    local = not storage.is_remote(p)
    if _MAGIC.search(p) and (storage.is_listable(p) or local and not os.path.exists(p)):
        return _matches(p, pat, metadata)
    if storage.is_listable(p) and p.endswith("/"):
        return _folder(p, pat, metadata)
    if local:
        return _resolved(p, pat, storage.path_kind(p), metadata)
    return None


def _missing_error(why: list[str]) -> InvalidInput:
    """One error for every input that names nothing, in input order (at most :data:`MAX_NAMED`)."""
    if len(why) == 1:
        return InvalidInput(why[0])
    more = f"; and {len(why) - MAX_NAMED} more" if len(why) > MAX_NAMED else ""
    return InvalidInput(
        f"{len(why)} inputs name nothing to index: {'; '.join(why[:MAX_NAMED])}{more}"
    )


def expand_paths(
    patterns: str | os.PathLike | Iterable[str | os.PathLike], *, metadata: str | None = None
) -> list[str]:
    """Expand every pattern (module doc) in order, each path once; each result must be an
    existing file, a local folder an input names, or an object in storage (``s3://``, ``gs://``,
    ``https://``). Every input that names nothing is named, with its pattern, in one
    InvalidInput, in input order: local and remote alike, found in one pass, not one per run.

    ``metadata``: the file each folder or prefix is read through (relative to it, or a path of
    its own); every input must then be a folder or prefix."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    slots: list[list[str]] = []
    missing: dict[int, str] = {}  # slot -> why it names nothing
    remote: list[tuple[int, str, str]] = []  # (slot, path, pattern): checked together
    for pattern in patterns:
        pat = os.fspath(pattern)
        for p in expand_braces(pat):
            try:
                got = _expand(p, pat, metadata)
            except _Missing as exc:
                missing[len(slots)], got = str(exc), []
            if got is None:
                remote.append((len(slots), p, pat))
            slots.append(got or [])
    for (slot, p, pat), kind in zip(remote, _kinds([p for _, p, _ in remote])):
        try:
            slots[slot] = _resolved(p, pat, kind, metadata)
        except _Missing as exc:
            missing[slot] = str(exc)
    if missing:
        raise _missing_error([missing[s] for s in sorted(missing)])
    every = [p for got in slots for p in got]
    # one input once (its samples would repeat in the index), however spelled: a/x.tar,
    # ./a/x.tar, its absolute path (real paths: link/../x.tar may be another file)
    first: dict[str, str] = {}
    for p in every:
        first.setdefault(p if storage.is_remote(p) else os.path.realpath(p), p)
    out = list(first.values())
    if len(out) < len(every):
        log.info("%d input(s) named more than once: each read once", len(every) - len(out))
    return out
