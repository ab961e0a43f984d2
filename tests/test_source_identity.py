"""A source file rewritten after indexing is refused by name, not read at the old positions; a copy
that did not keep its mtime (same bytes) is served.

The index records every file's identity (local: size + mtime_ns + a hash of its ends); a worker
compares it once when it opens the file, and reads the ends only when the mtime differs. Object
storage (ETag) is tested against a real S3 API in test_object_storage.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from entrain_data.workers import source_identity, sources
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


def paths_passed_to(monkeypatch, owner, name: str) -> list[str]:
    """The paths ``owner.name`` is called with from now on (it still runs)."""
    seen: list[str] = []
    real = getattr(owner, name)

    def counted(path, *args):
        seen.append(path)
        return real(path, *args)

    monkeypatch.setattr(owner, name, counted)
    return seen


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
    head_tail = source_identity.content_fingerprint(str(shard), st.st_size)
    want = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_tail": head_tail}
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


def test_shard_rewritten_with_the_same_size_is_refused_by_its_content(indexed):
    shard, index = indexed
    before = os.stat(shard)
    recorded = read_index(index).source_identity[str(shard)]["head_tail"]
    swapped = {k: v[::-1] for k, v in CAPTIONS.items()}  # same keys, same sizes, other bytes
    _rewrite(shard, swapped, before.st_mtime_ns + 10**9)  # re-exported a second later
    assert os.stat(shard).st_size == before.st_size
    with pytest.raises(SampleError) as err:
        make_packer(str(index))([], [0, 1])
    msg = str(err.value)
    now = source_identity.content_fingerprint(str(shard), before.st_size)
    assert msg.startswith(
        f"{shard}: changed since it was indexed (size {before.st_size} unchanged, "
        f"mtime_ns {before.st_mtime_ns} -> {before.st_mtime_ns + 10**9}, "
        f"head_tail {recorded} -> {now}): re-index"
    )
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
    calls = paths_passed_to(monkeypatch, sources, "vouch")
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


def _stage(tmp_path: Path, node: str) -> tuple[Path, Path]:
    """The dataset and its index copied as a per-node staging script does: bytes only, so every
    file gets the time of the copy (pushed a second on, in case the copy shares the index's tick)."""
    root = tmp_path / node
    for folder in ("data", "out"):
        shutil.copytree(tmp_path / folder, root / folder, copy_function=shutil.copyfile)
    shard = root / "data" / "s.tar"
    t = os.stat(tmp_path / "data" / "s.tar").st_mtime_ns + 10**9
    os.utime(shard, ns=(t, t))
    return shard, root / "out" / "index.parquet"


def test_a_copy_that_did_not_keep_mtimes_is_served(indexed, tmp_path):
    shard, index = indexed
    copy, copied_index = _stage(tmp_path, "node1")
    assert os.stat(copy).st_mtime_ns != os.stat(shard).st_mtime_ns
    out = make_packer(str(copied_index))([], [0, 1, 2])  # read through the copy's own path
    assert out.llm_keys == ["a", "b", "c"] and not out.skipped
    shutil.copyfile(copy, shard)  # copied back over the indexed file: same bytes, new mtime
    t = os.stat(copy).st_mtime_ns + 10**9
    os.utime(shard, ns=(t, t))
    out = make_packer(str(index))([], [0, 1, 2])
    assert out.llm_keys == ["a", "b", "c"] and not out.skipped


@pytest.fixture
def large(tmp_path):
    """A shard of 400+ KiB (its ends hashed, not all of it) and its index."""
    (tmp_path / "big").mkdir()
    captions = {"a": b"a" * 200_000, "b": b"a small one", "c": b"c" * 200_000}
    shard = write_shard(tmp_path / "big" / "s.tar", captions)
    index = write_index(build_index(str(shard), progress=False), tmp_path / "big" / "i.parquet")
    with tarfile.open(shard) as tar:
        first, *_, last = tar.getmembers()
    return shard, index, first.offset_data + 100, last.offset_data + last.size - 100


@pytest.mark.parametrize("where", ["head", "tail"])
def test_one_byte_flipped_at_either_end_is_refused_by_name(large, where):
    shard, index, head, tail = large
    before = os.stat(shard)
    at = head if where == "head" else tail
    assert (at < 1 << 16) if where == "head" else (at >= before.st_size - (1 << 16))
    data = bytearray(shard.read_bytes())
    data[at] ^= 0x01  # same size; the mtime moves as any rewrite's does
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(before.st_mtime_ns + 10**9,) * 2)
    with pytest.raises(SampleError) as err:
        make_packer(str(index))([], [1])
    msg = str(err.value)
    assert err.value.source == str(shard) and msg.startswith(f"{shard}: changed since it was")
    assert f"(size {before.st_size} unchanged, mtime_ns {before.st_mtime_ns} -> " in msg
    assert "head_tail " in msg and "re-index" in msg and "copy" not in msg


def test_middle_bytes_of_a_large_file_are_not_fingerprinted(large):
    """The documented limit (content_fingerprint): a same-size change between the ends of a file
    over 128 KiB keeps its fingerprint; the ends and the size are what it witnesses."""
    shard, _index, head, tail = large
    size = os.stat(shard).st_size
    before = source_identity.content_fingerprint(str(shard), size)
    data = bytearray(shard.read_bytes())
    data[size // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert source_identity.content_fingerprint(str(shard), size) == before
    data[tail] ^= 0x01
    shard.write_bytes(bytes(data))
    assert source_identity.content_fingerprint(str(shard), size) != before


def test_index_without_a_fingerprint_still_refuses_a_new_mtime(indexed):
    """An index from before ``head_tail``: compared by mtime, as it always was."""
    shard, index = indexed
    table = read_index(index)
    old = {
        p: {k: v for k, v in i.items() if k != "head_tail"}
        for p, i in table.source_identity.items()
    }
    write_index(replace(table, source_identity=old), index)
    assert read_index(index).source_identity == old
    t = os.stat(shard).st_mtime_ns
    os.utime(shard, ns=(t + 10**9,) * 2)  # identical bytes
    with pytest.raises(SampleError) as err:
        make_packer(str(index))([], [0])
    assert f"mtime_ns {t} -> {t + 10**9}): re-index (a copy that did not keep" in str(err.value)


def test_the_file_is_read_only_when_its_mtime_differs(indexed, monkeypatch):
    shard, index = indexed
    reads = paths_passed_to(monkeypatch, source_identity, "content_fingerprint")
    packer = make_packer(str(index))
    assert packer([], [0, 1, 2]).llm_keys == ["a", "b", "c"] and reads == []  # one stat only
    t = os.stat(shard).st_mtime_ns + 10**9
    os.utime(shard, ns=(t, t))
    copied = make_packer(str(index))  # another worker, after the copy
    for _ in range(3):
        assert copied([], [0, 1, 2]).llm_keys == ["a", "b", "c"]
    assert reads == [str(shard)]  # read once, when the source was opened
    _rewrite(shard, {**CAPTIONS, "c": b"x" * 12000}, t + 10**9)  # another size: no read needed
    assert len(make_packer(str(index), on_error="skip")([], [0]).skipped) == 1
    assert reads == [str(shard)]


def test_what_a_fingerprint_decides():
    from entrain_data.workers.source_identity import identity_change

    recorded = {"size": 5, "mtime_ns": 1, "head_tail": "h"}
    assert identity_change(recorded, {"size": 5, "mtime_ns": 2, "head_tail": "h"}) is None
    assert identity_change(recorded, {"size": 5, "mtime_ns": 2, "head_tail": "g"}) == (
        "size 5 unchanged, mtime_ns 1 -> 2, head_tail h -> g"
    )
    assert identity_change(recorded, {"size": 5, "mtime_ns": 2}) == (  # a stat alone
        "size 5 unchanged, mtime_ns 1 -> 2"
    )
    assert identity_change(recorded, {"size": 5, "mtime_ns": 1}) is None
    assert identity_change(recorded, {"size": 6, "mtime_ns": 2, "head_tail": "h"}) == (
        "size 5 -> 6, mtime_ns 1 -> 2, head_tail h unchanged"
    )


def test_a_copy_reopened_after_eviction_is_not_read_again(tmp_path, monkeypatch):
    """A copy accepted by its fingerprint was read again (128 KiB) every time the open-file cache
    evicted and reopened it: with more shards than ``max_open``, once per sample."""
    (tmp_path / "data").mkdir()
    shards = [write_shard(tmp_path / "data" / f"s{i}.tar", CAPTIONS) for i in range(2)]
    index = write_index(
        build_index([str(p) for p in shards], progress=False), tmp_path / "out" / "index.parquet"
    )
    for shard in shards:  # copied without its mtime
        t = os.stat(shard).st_mtime_ns + 10**9
        os.utime(shard, ns=(t, t))
    reads = paths_passed_to(monkeypatch, source_identity, "content_fingerprint")
    packer = make_packer(str(index), max_open=1)  # every other sample evicts the other shard
    for _ in range(3):
        assert len(packer([], [0, 3, 1, 4]).llm_keys) == 4
    assert sorted(reads) == sorted(str(p) for p in shards)  # each read once
