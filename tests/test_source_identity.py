"""A source file rewritten after indexing is refused by name, not read at the old positions.

The index records every file's identity (local: size + mtime_ns); a worker compares it once when
it opens the file. Object storage (ETag) is tested against a real S3 API in test_object_storage.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from entrain_data.workers import sources
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.packing import make_packer

from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import SampleMeta, SampleTable, read_index, write_index

pytestmark = pytest.mark.timeout(120)

CAPTIONS = {"a": b"a red kite over the hill", "b": b"two dogs on a beach", "c": b"a quiet room"}


def write_shard(path: Path, captions: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, text in captions.items():
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    return path


@pytest.fixture
def indexed(tmp_path):
    """A text shard and its index, written in another folder (sources stored relative)."""
    (tmp_path / "data").mkdir()
    shard = write_shard(tmp_path / "data" / "s.tar", CAPTIONS)
    index = write_index(build_index(str(shard), progress=False), tmp_path / "out" / "index.parquet")
    return shard, index


def test_index_records_each_files_identity_through_the_file(indexed, tmp_path):
    shard, index = indexed
    st = os.stat(shard)
    want = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    table = read_index(index)
    assert table.source_identity == {str(shard): want}  # keyed by the resolved source
    stored = pq.read_schema(index).metadata
    assert json.loads(stored[b"entrain_data.source_identity"]) == {"../data/s.tar": want}
    assert stored[b"entrain_data.index_schema_version"] == b"2"
    assert table.take([1]).source_identity == table.source_identity
    other = SampleTable.from_records(
        [SampleMeta("z", str(shard), 1, member="z")],
        source_identity={str(shard): {**want, "size": 1}},
    )
    with pytest.raises(InvalidInput, match="indexed .*s.tar as .*re-index them together"):
        SampleTable.concat([table, other])
    with pytest.raises(InvalidInput, match="source identity of 'x' is malformed"):
        SampleTable.from_records([], source_identity={"x": {"size": [1]}})


def _rewrite(shard: Path, captions: dict[str, bytes], mtime_ns: int) -> None:
    write_shard(shard, captions)
    os.utime(shard, ns=(mtime_ns, mtime_ns))


def test_shard_rewritten_with_the_same_size_is_refused_by_its_mtime(indexed):
    shard, index = indexed
    before = os.stat(shard)
    swapped = {k: v[::-1] for k, v in CAPTIONS.items()}  # same keys, same sizes, other bytes
    _rewrite(shard, swapped, before.st_mtime_ns + 10**9)  # re-exported a second later
    assert os.stat(shard).st_size == before.st_size
    with pytest.raises(SampleError) as err:
        make_packer(str(index))([], [0, 1])
    msg = str(err.value)
    assert msg.startswith(f"{shard}: changed since it was indexed (size {before.st_size} unchanged")
    assert f"mtime_ns {before.st_mtime_ns} -> {before.st_mtime_ns + 10**9}): re-index" in msg
    assert err.value.source == str(shard) and err.value.key == "a"
    out = make_packer(str(index), on_error="skip")([], [0, 1, 2])
    assert out.llm_keys == [] and [s["key"] for s in out.skipped] == ["a", "b", "c"]
    assert all("changed since it was indexed" in s["error"] for s in out.skipped)


def test_shard_rewritten_with_another_size_is_refused(indexed):
    shard, index = indexed
    before = os.stat(shard)
    longer = {**CAPTIONS, "c": b"x" * 12000}  # past the tar record of 10240 bytes
    _rewrite(shard, longer, before.st_mtime_ns)  # even with the old mtime put back
    after = os.stat(shard).st_size
    assert after != before.st_size
    with pytest.raises(SampleError, match=rf"\(size {before.st_size} -> {after}, mtime_ns "):
        make_packer(str(index))([], [2])


def test_a_source_is_checked_once_when_opened_not_per_sample(indexed, monkeypatch):
    shard, index = indexed
    calls: list[str] = []
    real = sources.changed_since_indexing

    def counted(path, recorded):
        calls.append(path)
        return real(path, recorded)

    monkeypatch.setattr(sources, "changed_since_indexing", counted)
    packer = make_packer(str(index), on_error="skip")
    assert packer([0], [0, 1]).llm_keys == ["a", "b"]
    assert packer([], [2]).llm_keys == ["c"] and calls == [str(shard)]
    _rewrite(shard, {k: v[::-1] for k, v in CAPTIONS.items()}, os.stat(shard).st_mtime_ns + 1)
    fresh = make_packer(str(index), on_error="skip")  # another worker process, say
    for _ in range(3):
        assert len(fresh([], [0, 1, 2]).skipped) == 3
    assert calls == [str(shard)] * 2  # the changed file is probed once, then refused from memory


def test_index_written_before_identities_still_serves(indexed, tmp_path):
    """No identity recorded (schema version 1): nothing to compare, served as before."""
    shard, index = indexed
    old = tmp_path / "out" / "old.parquet"
    arrow = pq.read_table(index)
    meta = arrow.schema.metadata
    del meta[b"entrain_data.source_identity"]
    meta[b"entrain_data.index_schema_version"] = b"1"
    pq.write_table(arrow.replace_schema_metadata(meta), old)
    assert read_index(old).source_identity == {}
    _rewrite(shard, {k: v.upper() for k, v in CAPTIONS.items()}, os.stat(shard).st_mtime_ns + 1)
    out = make_packer(str(old))([], [0, 1, 2])
    assert out.llm_keys == ["a", "b", "c"] and not out.skipped
    with pytest.raises(SampleError, match="changed since it was indexed"):
        make_packer(str(index))([], [0])
    assert read_index(write_index(replace(read_index(old)), old)).source_identity == {}


def test_what_is_compared():
    from entrain_data.workers.source_identity import identity_change

    same_bytes_new_version = identity_change(
        {"size": 5, "etag": "e1", "version": "v1"}, {"size": 5, "etag": "e1", "version": "v2"}
    )
    assert same_bytes_new_version is None  # the ETag witnesses the content
    assert identity_change({"size": 5, "generation": "1"}, {"size": 5, "generation": "2"}) == (
        "size 5 unchanged, generation 1 -> 2"
    )
    assert identity_change({"size": 5, "etag": "e1"}, {"size": 5}) is None  # nothing to compare
    assert identity_change({"size": 5, "etag": "a"}, {"size": 6, "etag": "b"}) == (
        "size 5 -> 6, etag a -> b"
    )
