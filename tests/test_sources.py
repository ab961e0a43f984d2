"""Random access into WebDataset shards (plain, gzip'd, truncated, corrupt), Parquet, torch Datasets."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from entrain_data.workers.demo_data import write_demo_dataset
from entrain_data.workers.sources import (
    ParquetSource,
    SourceCache,
    TarShard,
    TorchDatasetSource,
    expand_braces,
    expand_paths,
    open_source,
    split_member_name,
)

from entrain_data.errors import InvalidInput, SampleError


def write_shard(path: Path, samples: dict[str, dict[str, bytes]], gz: bool = False) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


SAMPLES = {
    f"s{i:03d}": {"txt": f"text {i}".encode() * (i + 1), "bin": bytes(range(i % 256)) * 3}
    for i in range(30)
}


def test_member_name_convention():
    assert split_member_name("dir/000123.seg.jpg") == ("dir/000123", "seg.jpg")
    assert split_member_name("a.b/k.txt") == ("a.b/k", "txt")
    assert split_member_name("noext") == ("noext", "")


def test_brace_expansion(tmp_path):
    assert expand_braces("s-{00..03}.tar") == [f"s-{i:02d}.tar" for i in range(4)]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("x{3..1}") == ["x3", "x2", "x1"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    for i in range(3):
        (tmp_path / f"p-{i}.tar").write_bytes(b"")
    assert len(expand_paths(str(tmp_path / "p-{0..2}.tar"))) == 3
    with pytest.raises(InvalidInput, match="p-3.tar"):
        expand_paths(str(tmp_path / "p-{0..3}.tar"))


@pytest.mark.parametrize("gz", [False, True])
def test_random_access_matches_written_bytes(tmp_path, gz):
    path = write_shard(tmp_path / ("a.tgz" if gz else "a.tar"), SAMPLES, gz=gz)
    shard = open_source(path)
    assert shard.keys() == list(SAMPLES)
    rng = np.random.default_rng(0)
    for key in rng.permutation(list(SAMPLES)):
        assert shard.read(str(key)) == SAMPLES[str(key)]
    assert shard.read("s007", exts=["txt"]) == {"txt": SAMPLES["s007"]["txt"]}
    with pytest.raises(SampleError) as err:
        shard.read("nope")
    assert err.value.key == "nope" and err.value.source == str(path)
    shard.close()


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_shard_names_the_cut_sample(tmp_path, gz):
    path = write_shard(tmp_path / ("t.tgz" if gz else "t.tar"), SAMPLES, gz=gz)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    shard = TarShard(path)
    assert shard.truncated
    keys = shard.keys()
    assert 0 < len(keys) < len(SAMPLES)
    for key in keys[:-1]:
        assert shard.read(key) == SAMPLES[key]
    with pytest.raises(SampleError, match="cut off") as err:
        shard.read(keys[-1])
    assert err.value.key == keys[-1] and err.value.source == str(path)


def test_corrupt_header_is_not_silent(tmp_path):
    path = write_shard(tmp_path / "c.tar", SAMPLES)
    raw = bytearray(path.read_bytes())
    shard = TarShard(path)
    off = shard.members("s010")["txt"].offset - 512  # that member's header block
    raw[off : off + 100] = b"\xff" * 100
    path.write_bytes(bytes(raw))
    bad = TarShard(path)
    assert bad.truncated
    assert "s010" not in bad.samples or not bad.members("s010").get("txt")
    with pytest.raises(SampleError, match="corrupt|cut off"):
        bad.read(bad.keys()[-1])
    assert bad.read("s003") == SAMPLES["s003"]


def test_not_a_tar(tmp_path):
    p = tmp_path / "x.tar"
    p.write_bytes(b"hello" * 300)
    with pytest.raises(SampleError) as err:
        TarShard(p)
    assert err.value.source == str(p)
    with pytest.raises(InvalidInput, match="unknown source kind"):
        open_source(tmp_path / "x.zip")


def test_parquet_rows_through_row_groups(tmp_path):
    n = 57
    table = pa.table({"text": [f"row {i}" for i in range(n)], "h": list(range(n))})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=10)
    src = ParquetSource(path)
    assert len(src.keys()) == n
    for i in (0, 9, 10, 56, 23, 3):
        assert src.read(i) == {"text": f"row {i}", "h": i}
    assert src.read("11", exts=["h"]) == {"h": 11}
    with pytest.raises(SampleError) as err:
        src.read(n)
    assert err.value.key == str(n)


def test_torch_dataset_source():
    class DS:
        def __len__(self):
            return 5

        def __getitem__(self, i):
            if i == 3:
                raise OSError("disk gone")
            return {"x": i}

    src = TorchDatasetSource(DS(), name="myds")
    assert src.keys() == ["0", "1", "2", "3", "4"]
    assert src.read("2") == {"sample": {"x": 2}}
    with pytest.raises(SampleError, match="disk gone") as err:
        src.read(3)
    assert (err.value.source, err.value.key) == ("myds", "3")
    with pytest.raises(InvalidInput):
        TorchDatasetSource(object())


def test_source_cache_keeps_few_open(tmp_path):
    paths = [write_shard(tmp_path / f"{i}.tar", SAMPLES) for i in range(3)]
    cache = SourceCache(max_open=2)
    for p in paths + paths[:1]:
        assert cache.read(str(p), "s001") == SAMPLES["s001"]
    assert len(cache._open) == 2
    cache.close()


def test_demo_shards_random_access(tmp_path):
    paths = write_demo_dataset(tmp_path, samples=16, shards=2, seed=1)
    for p in paths:
        with tarfile.open(p) as tar:
            want = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        shard = TarShard(p)
        got = {f"{k}.{e}": v for k in reversed(shard.keys()) for e, v in shard.read(k).items()}
        assert got == want


def test_real_webdataset_shards(shared_data):
    d = shared_data / "webdataset_testdata"
    comp = open_source(d / "compressed.tar")
    assert comp.keys() == ["compressed/0001", "compressed/0002", "compressed/0003"]
    import gzip

    assert gzip.decompress(comp.read("compressed/0002")["txt.gz"]) == b"world\n"
    tgz = open_source(d / "sample.tgz")
    assert len(tgz.keys()) == 90
    assert set(tgz.read("42")) == {"png", "cls"}
    testgz = open_source(d / "testgz.tar")
    assert len(testgz.keys()) == 1000
    with tarfile.open(d / "testgz.tar") as tar:
        m = tar.getmembers()[500]
        want = tar.extractfile(m).read()
    key, ext = split_member_name(m.name)
    assert testgz.read(key)[ext] == want
