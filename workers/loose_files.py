"""A local folder of loose media files with sidecar text, read as WebDataset reads a tar shard.

Files are grouped by key exactly as tar members are (:func:`.sources.split_member_name`):
``sub/0001.jpg``, ``sub/0001.txt`` and ``sub/0001.json`` form the sample ``sub/0001`` with members
``jpg``, ``txt``, ``json``. A group is a sample when it holds at least one image or audio file;
groups of text or unknown files only (``README.md``, ``STATS.json``) are not samples, and the index
says how many it passed over. Hidden files and folders (``.name``) are ignored.

A worker does not walk the whole tree: :meth:`DirectorySource.read` lists only the folder of the
key it is asked for (once, then cached), so a worker touching a few folders of a large tree pays
for those folders only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from entrain_data.errors import SampleError

from .decode import member_kind
from .sources import split_member_name

__all__ = ["DirectorySource", "group_folder"]

log = logging.getLogger(__name__)


def group_folder(root: str, sub: str = "") -> dict[str, dict[str, str]]:
    """``{key: {ext: file name}}`` of the files directly in ``root/sub`` (keys relative to root)."""
    folder = os.path.join(root, sub) if sub else root
    groups: dict[str, dict[str, str]] = {}
    with os.scandir(folder) as it:
        for entry in sorted(it, key=lambda e: e.name):
            if entry.name.startswith(".") or not entry.is_file():
                continue
            key, ext = split_member_name(entry.name)
            if not ext:
                continue
            groups.setdefault(f"{sub}/{key}" if sub else key, {})[ext] = entry.name
    return groups


def _is_sample(exts: dict[str, str]) -> bool:
    return any(member_kind(e) in ("image", "audio") for e in exts)


class DirectorySource:
    """Random access to the samples of a folder of loose files by key (see module doc)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path).rstrip("/") or "/"
        self._folders: dict[str, dict[str, dict[str, str]]] = {}
        self.passed_over = 0  # groups without an image or audio file (after keys())

    def _folder(self, sub: str) -> dict[str, dict[str, str]]:
        groups = self._folders.get(sub)
        if groups is None:
            try:
                groups = group_folder(self.path, sub)
            except OSError as exc:
                raise SampleError(
                    f"{self.path}: cannot list folder {sub or '.'!r} ({exc})", source=self.path
                ) from exc
            self._folders[sub] = groups
        return groups

    def keys(self) -> list[str]:
        """Every sample key of the tree, folders in sorted order, keys sorted within a folder."""
        out: list[str] = []
        self.passed_over = 0
        for dirpath, dirnames, _files in os.walk(self.path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            sub = os.path.relpath(dirpath, self.path)
            sub = "" if sub == "." else sub.replace(os.sep, "/")
            for key, exts in self._folder(sub).items():
                if _is_sample(exts):
                    out.append(key)
                else:
                    self.passed_over += 1
        return out

    def members(self, key: str) -> dict[str, str]:
        """Extensions of one sample and the file name of each."""
        sub = key.rsplit("/", 1)[0] if "/" in key else ""
        exts = self._folder(sub).get(key)
        if not exts:
            raise SampleError(
                f"{self.path}: no files for key {key!r} in this folder", source=self.path, key=key
            )
        return exts

    def read(
        self,
        member: str,
        exts: Sequence[str] | None = None,
        limit: int | Mapping[str, int] | None = None,
    ) -> dict[str, bytes]:
        """File contents of sample ``member`` by extension (at most ``limit`` bytes of each, or
        of the extensions a ``limit`` mapping names)."""
        sub = member.rsplit("/", 1)[0] if "/" in member else ""
        out: dict[str, bytes] = {}
        for ext, name in self.members(member).items():
            if exts is not None and ext not in exts:
                continue
            path = os.path.join(self.path, sub, name)
            try:
                with open(path, "rb") as f:
                    cap = limit if isinstance(limit, int) else (limit or {}).get(ext)
                    out[ext] = f.read() if cap is None else f.read(cap)
            except OSError as exc:
                raise SampleError(
                    f"{self.path}: sample {member!r}: cannot read {path} ({exc})",
                    source=self.path,
                    key=member,
                ) from exc
        return out

    def close(self) -> None:
        self._folders.clear()
