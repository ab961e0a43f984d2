"""An index finds its samples from any working directory, and after moving with its data: local
sources are stored relative to the index file and resolved against it when read."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from entrain_data.workers.demo_data import write_demo_dataset
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.sources import SourceCache

from entrain_data.metadata import read_index, write_index


def _read_all(table) -> int:
    cache = SourceCache()
    try:
        return sum(
            len(cache.read(str(s), str(m))) > 0 for s, m in zip(table.sources, table.members)
        )
    finally:
        cache.close()


def test_index_typed_relative_is_read_from_another_directory_and_after_a_move(
    tmp_path, monkeypatch
):
    root = tmp_path / "job"
    write_demo_dataset(root / "data", samples=12, shards=2, seed=0)
    monkeypatch.chdir(root)
    out = root / "indexes" / "index.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "entrain_data.cli", "index", "data/demo-000.tar",
         "data/demo-001.tar", "-o", str(out), "-q"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    stored = {str(s) for s in read_index(out).sources}
    monkeypatch.chdir(tmp_path)  # another working directory (another node's service)
    table = read_index(out)
    assert all(os.path.isfile(str(s)) for s in table.sources), stored
    assert _read_all(table) == len(table)
    moved = tmp_path / "moved"
    shutil.move(str(root), str(moved))  # the data and its index move together
    table = read_index(moved / "indexes" / "index.parquet")
    assert all(str(s).startswith(str(moved)) for s in table.sources)
    assert _read_all(table) == len(table)


def test_urls_and_names_that_are_not_files_are_stored_as_they_are(tmp_path):
    write_demo_dataset(tmp_path / "d", samples=4, shards=1, seed=0)
    table = build_index([str(tmp_path / "d" / "demo-000.tar")], progress=False)
    from dataclasses import replace

    import numpy as np

    odd = np.array(
        ["s3://bucket/shard.tar", "synthetic:x"] + ["x"] * (len(table) - 2), dtype=object
    )
    path = write_index(replace(table, sources=odd), tmp_path / "i.parquet")
    assert [str(s) for s in read_index(path).sources[:2]] == [
        "s3://bucket/shard.tar",
        "synthetic:x",
    ]
