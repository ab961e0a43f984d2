"""Where an index's samples live, independent of the directory a command runs from.

``entrain-data index data/shard-000.tar -o out/index.parquet`` is typed relative to one working
directory; ``serve`` on another node, or from another directory, must still find the shard. The
index therefore stores every local source relative to its own directory (URLs and names that
are not local files, such as ``synthetic:...``, as they are), and reading it resolves them back:
an index moved together with its data, or read from anywhere, keeps working.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["sources_for_index", "sources_from_index"]


def _is_local(source: str) -> bool:
    return "://" not in source and os.path.exists(source)


def sources_for_index(sources: np.ndarray, index_dir: str) -> np.ndarray:
    """Local sources rewritten relative to ``index_dir`` (what the index file stores)."""
    out = np.empty(len(sources), dtype=object)
    seen: dict[str, str] = {}
    for i, s in enumerate(sources):
        s = str(s)
        if s not in seen:
            seen[s] = os.path.relpath(os.path.abspath(s), index_dir) if _is_local(s) else s
        out[i] = seen[s]
    return out


def sources_from_index(sources: np.ndarray, index_dir: str) -> np.ndarray:
    """Stored relative sources resolved against ``index_dir`` where the file is there."""
    out = np.empty(len(sources), dtype=object)
    seen: dict[str, str] = {}
    for i, s in enumerate(sources):
        s = str(s)
        if s not in seen:
            here = os.path.normpath(os.path.join(index_dir, s))
            relative = "://" not in s and not os.path.isabs(s)
            seen[s] = here if relative and os.path.exists(here) else s
        out[i] = seen[s]
    return out
