"""Local paths and object storage (``s3://``, ``gs://``, ``https://`` ...) behind one small API.

Object storage goes through fsspec, so credentials and endpoints come from the environment each
backend already reads (``AWS_ACCESS_KEY_ID`` / ``AWS_ENDPOINT_URL`` / ``~/.aws`` for s3fs,
``GOOGLE_APPLICATION_CREDENTIALS`` for gcsfs ...); nothing here holds a secret. Reads are byte
ranges: the index passes over a tar shard in large read-ahead ranges and reads a Parquet footer,
then only the column chunks it needs; workers fetch one sample's members with one ranged GET.

Public API: ``is_remote(path)``, ``filesystem(path) -> (fs, path)``, ``is_file(path)``,
``is_dir(path)``, ``path_kind(path)``, ``is_listable(path)``, ``list_objects(prefix)``,
``glob_objects(pattern)``, ``open_ranged(path) -> file``, ``read_range(path, start, end) -> bytes``,
``read_all(path) -> bytes``, ``open_parquet(path) -> pyarrow.parquet.ParquetFile``,
``object_info(path) -> dict``, ``failure_kind(exc) -> str``.

Failures say what went wrong: only a genuinely missing object is "not found" (``is_file`` False, a
read's ``FileNotFoundError``); a refused credential or an unreachable endpoint is an
``InvalidInput`` from ``is_file`` and the listings, a ``PermissionError`` / ``OSError`` from a read, each naming the
object. Every backend error leaves here as an ``OSError`` (aiohttp and botocore raise their own),
so a failed read is one sample's error under the skip policy, not a crash. Transient failures (HTTP
5xx/429, a dropped connection) are tried again with backoff where the backend does not retry
itself: fsspec's HTTP filesystem does not; s3fs (botocore's retries) and gcsfs do.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyarrow.parquet as pq

from entrain_data.errors import InvalidInput

__all__ = [
    "HEADER_BLOCK",
    "INDEX_BLOCK",
    "is_remote",
    "filesystem",
    "is_file",
    "is_dir",
    "path_kind",
    "is_listable",
    "list_objects",
    "glob_objects",
    "open_ranged",
    "read_range",
    "read_all",
    "open_parquet",
    "object_info",
    "failure_kind",
    "RETRY_ATTEMPTS",
    "RETRY_BACKOFF_S",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

HEADER_BLOCK = 1 << 20
"""Read-ahead block of a worker's header scan: an object-storage request costs tens of
milliseconds before its first byte, about the time to stream a megabyte, so a smaller block
saves little transfer and costs more requests."""

INDEX_BLOCK = 1 << 22
"""Read-ahead block of the index's pass over a shard (headers and the members it reads)."""

RETRY_ATTEMPTS = 4
"""Tries of one request that fails transiently, where the backend does not retry itself."""

RETRY_BACKOFF_S = 0.25
"""Wait before the second try, doubled before each next (0.25 + 0.5 + 1 s in all): rides out a
load balancer's brief 503s without holding a worker long on an object that is really down."""

_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_SELF_RETRYING = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})
"""Backends whose clients retry their own requests (botocore under s3fs, gcsfs, the Azure SDK):
a loop of ours on top would multiply the waits."""
# Third-party errors matched by class name: the backends (aiohttp, botocore) are optional imports.
_UNREACHABLE_NAMES = frozenset(
    {"ClientConnectorError", "EndpointConnectionError", "ConnectTimeoutError"}
)
_DROPPED_NAMES = frozenset(
    {"ServerDisconnectedError", "ClientPayloadError", "ConnectionClosedError"}
)
# A timeout is not retried: the backend's own (aiohttp's 300 s) would be waited out again.


def is_remote(path: str | os.PathLike) -> bool:
    """True for a URL with a scheme other than ``file://`` (``s3://b/k``, ``https://h/p`` ...)."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def filesystem(path: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``path`` (cached per process by fsspec) and the path inside it."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as exc:
        scheme = path.split("://", 1)[0]
        raise InvalidInput(
            f"{path}: no filesystem for {scheme}:// ({exc}); install its fsspec backend "
            "(s3fs for s3://, gcsfs for gs://, aiohttp for https://)"
        ) from exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes: backends wrap the informative error (HTTP's ``_info`` raises a bare
    ``FileNotFoundError`` from the 403 or 503 it got)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _status(exc: BaseException) -> int | None:
    """The HTTP status of the chain: aiohttp's ``status``, botocore's response metadata."""
    for e in _chain(exc):
        status = getattr(e, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def failure_kind(exc: BaseException) -> str:
    """Why a storage request failed: ``missing``, ``denied`` (credentials or access policy),
    ``unreachable`` (endpoint), ``transient`` (5xx/429, dropped connection: worth a retry) or
    ``error``."""
    status = _status(exc)
    if status in (404, 410):
        return "missing"
    if status in (401, 403):
        return "denied"
    if status in _TRANSIENT_STATUS:
        return "transient"
    chain = list(_chain(exc))
    names = {type(e).__name__ for e in chain}
    if any(isinstance(e, PermissionError) for e in chain):
        return "denied"
    if names & _UNREACHABLE_NAMES or any(
        isinstance(e, (ConnectionRefusedError, socket.gaierror)) for e in chain
    ):
        return "unreachable"
    if names & _DROPPED_NAMES or any(
        isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError))
        for e in chain
    ):
        return "transient"
    if status is None and isinstance(exc, FileNotFoundError):
        return "missing"
    return "error"


def _describe(exc: BaseException) -> str:
    """The informative error of the chain, not the bare ``FileNotFoundError(url)`` around it."""
    for e in _chain(exc):
        if getattr(e, "_entrain_wrapper", False):
            continue  # one of ours (:func:`_as_oserror`): it already names the object
        if not (type(e) is FileNotFoundError and e.__cause__ is not None):
            return f"{type(e).__name__}: {e}"
    return f"{type(exc).__name__}: {exc}"


def _retries_itself(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(set(protocols) & _SELF_RETRYING)


def _as_oserror(exc: Exception, path: str, tries: int = 1) -> OSError:
    """Backends raise their own errors (aiohttp's ``ClientResponseError`` for an HTTP 403 or
    500); callers handle ``OSError``, so a failed read becomes one sample error, not a crash. The
    type says the kind (``FileNotFoundError``, ``PermissionError``); the message names the object."""
    cls = {"missing": FileNotFoundError, "denied": PermissionError}.get(failure_kind(exc), OSError)
    again = f" (after {tries} tries)" if tries > 1 else ""
    err = cls(f"{path}: {_describe(exc)}{again}")
    err.__cause__ = exc
    err._entrain_wrapper = True  # type: ignore[attr-defined]
    return err


def _call(fs: Any, path: str, fn: Callable[[], T]) -> T:
    """``fn()``, tried again after a transient failure (:data:`RETRY_ATTEMPTS` in all, backoff
    from :data:`RETRY_BACKOFF_S`) unless the backend retries itself; the last failure leaves as
    an ``OSError`` naming ``path``."""
    tries = 1 if _retries_itself(fs) else max(1, RETRY_ATTEMPTS)
    for attempt in range(1, tries + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == tries or failure_kind(exc) != "transient":
                raise _as_oserror(exc, path, attempt) from exc
            log.debug("%s: %s; try %d of %d", path, _describe(exc), attempt + 1, tries)
            time.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def _unusable(path: str, exc: OSError) -> InvalidInput:
    """Why a request about ``path`` failed when not because it is missing: "not found" would send
    the user looking for the wrong fault."""
    why = {
        "denied": "permission denied: check the credentials the backend reads (AWS_ACCESS_KEY_ID"
        " / AWS_PROFILE / ~/.aws for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://) and the"
        " object's access policy",
        "unreachable": "cannot reach the storage endpoint: check its URL (AWS_ENDPOINT_URL for"
        " s3://), the network and any proxy",
        "transient": "the storage service keeps failing",
    }.get(failure_kind(exc), "cannot tell whether it exists")
    return InvalidInput(f"{path}: {why} ({_describe(exc)})")


def path_kind(path: str) -> str | None:
    """``"file"``, ``"directory"`` (a local folder, an object-storage prefix) or None if missing:
    one HEAD for object storage (s3fs lists the prefix too when no object has that key).

    A refused credential or an unreachable endpoint raises InvalidInput (:func:`_unusable`).
    """
    if not is_remote(path):
        return "file" if os.path.isfile(path) else "directory" if os.path.isdir(path) else None
    fs, p = filesystem(path)
    try:
        kind = _call(fs, path, lambda: fs.info(p)).get("type")
    except OSError as exc:
        if failure_kind(exc) == "missing":
            return None
        raise _unusable(path, exc) from exc
    return kind if kind in ("file", "directory") else None


def is_file(path: str) -> bool:
    """Whether ``path`` names an existing file (one HEAD request for object storage).

    Only a missing object is False: a refused credential or an unreachable endpoint raises
    InvalidInput saying so, since "not found" would send the user looking for the wrong fault.
    """
    if not is_remote(path):
        return os.path.isfile(path)
    return path_kind(path) == "file"


def is_dir(path: str) -> bool:
    """Whether ``path`` is a local directory (loose files are read from local folders only)."""
    return not is_remote(path) and os.path.isdir(path)


def is_listable(path: str) -> bool:
    """Object storage whose keys can be listed: not ``http(s)://``, where a listing would be a
    scraped HTML page and ``?`` starts a query string (a presigned URL), not a wildcard."""
    return is_remote(path) and path.split("://", 1)[0].lower() not in ("http", "https")


def _listing(path: str, fn: Callable[[Any, str], dict[str, dict]], kind: str = "file") -> list[str]:
    """The files (``kind="directory"``: the prefixes) of one listing call as URLs in ``path``'s
    scheme, sorted; a missing bucket lists nothing, a refused or unreachable one raises
    InvalidInput naming ``path``."""
    scheme = path.split("://", 1)[0]
    fs, p = filesystem(path)
    fs.invalidate_cache()  # whole: a glob reads the cached listings of every folder it walks
    try:
        found = _call(fs, path, lambda: fn(fs, p))
    except OSError as exc:
        if failure_kind(exc) == "missing":
            return []
        if isinstance(exc.__cause__, ValueError):  # fsspec's word on a malformed glob
            raise InvalidInput(f"{path}: not a valid pattern ({exc.__cause__})") from exc
        raise _unusable(path, exc) from exc
    names = (info.get("name", name) for name, info in found.items() if info.get("type") == kind)
    return sorted(f"{scheme}://{n.lstrip('/')}" for n in names)


def list_objects(prefix: str) -> list[str]:
    """Every object under ``prefix`` (recursively) with one listing, no HEAD per object."""
    return _listing(prefix, lambda fs, p: fs.find(p.rstrip("/") + "/", withdirs=False, detail=True))


def glob_objects(pattern: str, kind: str = "file") -> list[str]:
    """The objects (``kind="directory"``: the prefixes) matching a ``*``/``?``/``[...]``/``**``
    pattern, from listings only."""
    return _listing(pattern, lambda fs, p: fs.glob(p, detail=True), kind)


def _guard(f: Any, fs: Any, path: str) -> Any:
    """An open remote file whose range reads retry and fail as :func:`_call`'s do: those reads
    happen later, inside the file's read-ahead cache (the tar scan, Parquet column chunks)."""
    cache = getattr(f, "cache", None)
    fetch = getattr(cache, "fetcher", None)
    if fetch is not None:
        cache.fetcher = lambda start, end: _call(fs, path, lambda: fetch(start, end))
    return f


def open_ranged(path: str, block_size: int = HEADER_BLOCK) -> Any:
    """A seekable binary file; remote ones fetch ``block_size`` read-ahead ranges on demand."""
    if not is_remote(path):
        return open(path, "rb")  # noqa: SIM115 - the caller owns and closes it
    fs, p = filesystem(path)
    f = _call(fs, path, lambda: fs.open(p, "rb", block_size=block_size, cache_type="readahead"))
    return _guard(f, fs, path)


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``path``: one ranged GET for object storage."""
    if not is_remote(path):
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, p = filesystem(path)
    return _call(fs, path, lambda: fs.cat_file(p, start=start, end=end))


def read_all(path: str) -> bytes:
    """The whole file (a gzip'd shard, a sidecar or metadata file)."""
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    return _call(fs, path, lambda: fs.cat_file(p))


def object_info(path: str) -> dict[str, Any]:
    """The backend's ``info()`` of a remote ``path`` as it is now: one HEAD, never an entry of a
    listing this process cached (that would describe the object as it was)."""
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    return _call(fs, path, lambda: fs.info(p))


def open_parquet(path: str) -> pq.ParquetFile:
    """A Parquet table; remote ones read the footer, then only the column chunks asked for."""
    if not is_remote(path):
        return pq.ParquetFile(path)
    f = open_ranged(path)
    try:
        return pq.ParquetFile(f)
    except BaseException:
        f.close()
        raise
