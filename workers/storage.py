"""Local paths and object storage (``s3://``, ``gs://``, ``https://`` ...) behind one small API.

Object storage goes through fsspec, so credentials and endpoints come from the environment each
backend already reads (``AWS_ACCESS_KEY_ID`` / ``AWS_ENDPOINT_URL`` / ``~/.aws`` for s3fs,
``GOOGLE_APPLICATION_CREDENTIALS`` for gcsfs ...); nothing here holds a secret. Reads are byte
ranges: the index passes over a tar shard in large read-ahead ranges and reads a Parquet footer,
then only the column chunks it needs; workers fetch one sample's members with one ranged GET.

Public API: ``is_remote(path)``, ``filesystem(path) -> (fs, path)``, ``is_file(path)``,
``is_dir(path)``, ``open_ranged(path) -> file``, ``read_range(path, start, end) -> bytes``,
``read_all(path) -> bytes``, ``open_parquet(path) -> pyarrow.parquet.ParquetFile``.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow.parquet as pq

from entrain_data.errors import InvalidInput

__all__ = [
    "HEADER_BLOCK",
    "INDEX_BLOCK",
    "is_remote",
    "filesystem",
    "is_file",
    "is_dir",
    "open_ranged",
    "read_range",
    "read_all",
    "open_parquet",
]

HEADER_BLOCK = 1 << 20
"""Read-ahead block of a worker's header scan: an object-storage request costs tens of
milliseconds before its first byte, about the time to stream a megabyte, so a smaller block
saves little transfer and costs more requests."""

INDEX_BLOCK = 1 << 22
"""Read-ahead block of the index's pass over a shard (headers and the members it reads)."""


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


def is_file(path: str) -> bool:
    """Whether ``path`` names an existing file (one HEAD request for object storage)."""
    if not is_remote(path):
        return os.path.isfile(path)
    fs, p = filesystem(path)
    try:
        return bool(fs.isfile(p))
    except (OSError, ValueError):
        return False


def is_dir(path: str) -> bool:
    """Whether ``path`` is a local directory (loose files are read from local folders only)."""
    return not is_remote(path) and os.path.isdir(path)


def open_ranged(path: str, block_size: int = HEADER_BLOCK) -> Any:
    """A seekable binary file; remote ones fetch ``block_size`` read-ahead ranges on demand."""
    if not is_remote(path):
        return open(path, "rb")  # noqa: SIM115 - the caller owns and closes it
    fs, p = filesystem(path)
    try:
        return fs.open(p, "rb", block_size=block_size, cache_type="readahead")
    except Exception as exc:
        raise _as_oserror(exc) from exc


def _as_oserror(exc: Exception) -> OSError:
    """Backends raise their own errors (aiohttp's ``ClientResponseError`` for an HTTP 403 or
    500); callers handle ``OSError``, so a failed read becomes one sample error, not a crash."""
    if isinstance(exc, OSError):
        return exc
    err = OSError(f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``path``: one ranged GET for object storage."""
    if not is_remote(path):
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, p = filesystem(path)
    try:
        return fs.cat_file(p, start=start, end=end)
    except Exception as exc:
        raise _as_oserror(exc) from exc


def read_all(path: str) -> bytes:
    """The whole file (a gzip'd shard, a sidecar file)."""
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    try:
        return fs.cat_file(p)
    except Exception as exc:
        raise _as_oserror(exc) from exc


def open_parquet(path: str) -> pq.ParquetFile:
    """A Parquet table; remote ones read the footer, then only the column chunks asked for."""
    if not is_remote(path):
        return pq.ParquetFile(path)
    fs, p = filesystem(path)
    return pq.ParquetFile(fs.open(p, "rb", block_size=HEADER_BLOCK, cache_type="readahead"))
