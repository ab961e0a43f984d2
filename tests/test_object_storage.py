"""Shards and tables in object storage: a real S3 API (moto's server mode) on loopback.

Indexed by byte range (tar headers, Parquet footers), served by workers reading members by
range, credentials and endpoint from the usual AWS environment variables; a shard deleted
mid-epoch under both error policies.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import replace

import pytest
from _s3 import s3_server
from test_client import demo_plan

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import read_index, write_index

pytestmark = [pytest.mark.timeout(180), pytest.mark.shared_data]

s3fs = pytest.importorskip("s3fs", reason="s3fs (test extra) not installed")
pytest.importorskip("moto.server", reason="moto[server] (test extra) not installed")


def coco_shards(shared_data, tmp_path, shards: int = 2, per_shard: int = 12) -> list:
    """Tar shards of real COCO images with their first caption (``key.jpg`` + ``key.txt``)."""
    rows = [json.loads(x) for x in (shared_data / "coco_mini" / "captions.jsonl").open()]
    paths = []
    for s in range(shards):
        path = tmp_path / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for r in rows[s * per_shard : (s + 1) * per_shard]:
                stem = r["file_name"].rsplit(".", 1)[0]
                for name, data in (
                    (f"{stem}.jpg", (shared_data / "coco_mini" / r["path"]).read_bytes()),
                    (f"{stem}.txt", r["captions"][0].encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


@pytest.fixture
def bucket(tmp_path, shared_data):
    """``s3://data`` holding two COCO shards and the real caption table; yields the filesystem."""
    with s3_server():
        fs = s3fs.S3FileSystem()
        fs.mkdir("data")
        for p in coco_shards(shared_data, tmp_path):
            fs.put_file(str(p), f"data/{p.name}")
        fs.put_file(str(shared_data / "parquet_captions" / "test_1000.parquet"), "data/t.parquet")
        yield fs


def test_index_over_s3_equals_the_local_index(bucket, tmp_path):
    from entrain_data.workers.index_builder import build_index

    remote = build_index("s3://data/shard-{000..001}.tar", progress=False)
    local = build_index(str(tmp_path / "shard-{000..001}.tar"), progress=False)
    assert list(remote.sources) == [s.replace(str(tmp_path), "s3://data") for s in local.sources]
    assert [replace(r, source="") for r in remote] == [replace(r, source="") for r in local]
    table = build_index("s3://data/t.parquet", progress=False, parquet_columns={"text": "TEXT"})
    assert len(table) == 1000 and table.column_map == {"text": "TEXT"}
    with pytest.raises(InvalidInput, match="not found: s3://data/nope.tar"):
        build_index("s3://data/nope.tar", progress=False)


def _serve(index, tmp_path, *, global_batch, on_error="raise", skipped=None, after_first=None):
    """Both ranks' microbatches; ``after_first()`` runs once both hold their first microbatch."""
    from entrain_data.workers.service import start_service

    plan = demo_plan(dp=2, microbatches=2, global_batch=global_batch)
    svc = start_service(
        plan=plan,
        index=index,
        workers=2,
        window=1,
        on_error=on_error,
        skipped_path=skipped,
        max_skipped=None,  # a whole shard gone is far over the default 1% budget
        socket_dir=str(tmp_path / "entrain-s"),
    )
    loaders = [EntrainLoader(svc.endpoint, r, timeout=60, prefetch=1) for r in (0, 1)]
    try:
        its = [iter(ld) for ld in loaders]
        got = [next(it) for it in its]
        if after_first is not None:
            after_first()
        for pair in zip(*its):
            got.extend(pair)
        return got
    finally:
        for ld in loaders:
            ld.close()
        svc.close()
        assert not (tmp_path / "entrain-s").exists()


@pytest.mark.slow
def test_shards_and_table_in_s3_served_exactly_once(bucket, tmp_path):
    from entrain_data.workers.index_builder import build_index

    for inputs, cols, batch in (
        ("s3://data/shard-{000..001}.tar", None, 8),
        ("s3://data/t.parquet", {"text": "TEXT"}, 500),
    ):
        index = tmp_path / "index.parquet"
        write_index(build_index(inputs, progress=False, parquet_columns=cols), index)
        keys = sorted(read_index(index).keys)
        mbs = _serve(index, tmp_path, global_batch=batch)
        assert sorted(k for m in mbs for k in m.encoder_keys) == keys
        assert sorted(k for m in mbs for k in m.llm_keys) == keys
    assert any("pixel_values" in m for m in _serve_images(bucket, tmp_path))


def _serve_images(bucket, tmp_path):
    from entrain_data.workers.index_builder import build_index

    index = tmp_path / "img.parquet"
    write_index(build_index("s3://data/shard-000.tar", progress=False), index)
    return _serve(index, tmp_path, global_batch=12)


@pytest.mark.parametrize("policy", [pytest.param("raise", marks=pytest.mark.slow), "skip"])
def test_shard_deleted_mid_epoch(bucket, tmp_path, policy):
    from entrain_data.workers.index_builder import build_index

    index = tmp_path / "index.parquet"
    write_index(build_index("s3://data/shard-{000..001}.tar", progress=False), index)
    table = read_index(index)
    gone = {str(k) for k, s in zip(table.keys, table.sources) if s.endswith("shard-001.tar")}
    skipped = tmp_path / "skipped.jsonl"

    def delete() -> None:
        bucket.rm("data/shard-001.tar")

    if policy == "raise":
        with pytest.raises(SampleError, match=r"s3://data/shard-001\.tar: sample '\d+'") as err:
            _serve(index, tmp_path, global_batch=4, after_first=delete)
        assert any(k in str(err.value) for k in gone)
        return
    mbs = _serve(
        index, tmp_path, global_batch=4, on_error="skip", skipped=str(skipped), after_first=delete
    )
    served = [k for m in mbs for k in m.llm_keys]
    lost = {json.loads(line)["key"] for line in skipped.read_text().splitlines()}
    assert len(served) == len(set(served))  # never twice
    assert lost and lost <= gone  # only the deleted shard's samples, and some of them
    assert set(served) | lost == set(table.keys) and not set(served) & lost


def test_index_over_plain_https_style_urls(bucket, tmp_path):
    """``http(s)://`` goes through fsspec's HTTP filesystem: HEAD for the size, Range GETs."""
    from entrain_data.workers.index_builder import build_index
    from entrain_data.workers.sources import TarShard

    base = os.environ["AWS_ENDPOINT_URL"]  # moto serves public objects by plain GET as well
    for name in ("shard-000.tar", "shard-001.tar"):
        bucket.chmod(f"data/{name}", acl="public-read")
    table = build_index(f"{base}/data/shard-{{000..001}}.tar", progress=False)
    local = build_index(str(tmp_path / "shard-{000..001}.tar"), progress=False)
    assert [replace(r, source="") for r in table] == [replace(r, source="") for r in local]
    shard = TarShard(f"{base}/data/shard-000.tar")
    key = shard.keys()[3]
    assert shard.read(key) == TarShard(str(tmp_path / "shard-000.tar")).read(key)


@pytest.mark.parametrize("name", ["metadata.jsonl", "llava.json", "metadata.csv"])
def test_metadata_file_and_its_images_in_s3(bucket, shared_data, tmp_path, name):
    """A metadata file in a bucket with its images beside it: indexed as its local copy is, and
    served as workers read it (the one record at its byte offset, the images by range)."""
    import csv

    from entrain_data.workers.index_builder import build_index
    from entrain_data.workers.sources import open_source

    coco = shared_data / "coco_mini"
    rows = [json.loads(x) for x in (coco / "captions.jsonl").open()][:5]
    recs = [{"file_name": r["path"], "text": r["captions"][0]} for r in rows]
    local = tmp_path / "meta"
    (local / "images").mkdir(parents=True)
    with (local / name).open("w", newline="") as f:
        if name.endswith(".csv"):
            w = csv.DictWriter(f, ["file_name", "text"])
            w.writeheader()
            w.writerows(recs)
        elif name.endswith(".json"):
            f.write("[\n" + ",\n".join(json.dumps(r) for r in recs) + "\n]\n")
        else:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    for r in rows:
        (local / r["path"]).write_bytes((coco / r["path"]).read_bytes())
    bucket.put(str(local), "data/meta", recursive=True)

    remote = build_index(f"s3://data/meta/{name}", progress=False)
    there = build_index(str(local / name), progress=False)
    assert remote.sources[0] == f"s3://data/meta/{name}"
    assert [replace(r, source="") for r in remote] == [replace(r, source="") for r in there]
    src = open_source(remote.sources[0], metadata_columns=remote.column_map)
    ref = open_source(there.sources[0], metadata_columns=there.column_map)
    for member in reversed(remote.members.tolist()):
        got = src.read(member)
        assert got == ref.read(member) and len(got) == 2  # caption and image bytes
    bucket.rm(f"data/meta/{rows[1]['path']}")
    with pytest.raises(SampleError, match=rf"s3://data/meta/{name}:\d+: cannot read s3://"):
        src.read(remote.members[1])


def test_cli_indexes_a_prefix_and_a_glob_as_the_brace_pattern(bucket, tmp_path, capsys):
    """``entrain-data index s3://bucket/prefix/`` and ``'s3://bucket/shard-*.tar'``: the shards
    listed under the prefix (a README and a hidden object passed over), as the braces name them."""
    from entrain_data.cli import main

    for name in ("shard-000.tar", "shard-001.tar"):
        bucket.copy(f"data/{name}", f"data/shards/{name}")
    bucket.pipe_file("data/shards/README.md", b"# shards\n")
    bucket.pipe_file("data/shards/.partial.tar", b"\0" * 512)
    indexes = {}
    for inputs in ("s3://data/shard-{000..001}.tar", "s3://data/shards/", "s3://data/shard-*.tar"):
        out = tmp_path / f"{len(indexes)}.parquet"
        assert main(["index", inputs, "-o", str(out), "-q"]) == 0, capsys.readouterr().err
        indexes[inputs] = read_index(out)
    braces = indexes.pop("s3://data/shard-{000..001}.tar")
    for inputs, table in indexes.items():
        assert sorted(table.keys) == sorted(braces.keys), inputs
        assert {s.rsplit("/", 1)[1] for s in table.sources} == {"shard-000.tar", "shard-001.tar"}
    assert main(["index", "s3://data/none/", "-o", str(tmp_path / "x.parquet"), "-q"]) == 2
    assert "no objects under s3://data/none/" in capsys.readouterr().err


def test_object_overwritten_after_indexing_is_refused_by_name(bucket, tmp_path):
    """An object overwritten after indexing (same keys and size, other bytes: a re-export) is not
    read at the old positions: its samples are skipped, each naming the object and both ETags;
    an index written before identities were recorded serves it unchecked, as before."""
    import pyarrow.parquet as pq
    from entrain_data.workers.index_builder import build_index
    from entrain_data.workers.packing import make_packer

    index = tmp_path / "index.parquet"
    write_index(build_index("s3://data/shard-*.tar", progress=False), index)  # from a listing
    table = read_index(index)
    before = bucket.info("data/shard-001.tar")
    assert table.source_identity["s3://data/shard-001.tar"] == {
        "size": before["size"],
        "etag": before["ETag"].strip('"'),
    }
    with tarfile.open(tmp_path / "shard-001.tar") as tar:  # the local copy the bucket holds
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(tmp_path / "re.tar", "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data[::-1] if info.name.endswith(".txt") else data))
    bucket.put_file(str(tmp_path / "re.tar"), "data/shard-001.tar")
    after = bucket.info("data/shard-001.tar")
    assert after["size"] == before["size"] and after["ETag"] != before["ETag"]
    changed = (
        "s3://data/shard-001.tar: changed since it was indexed (size "
        f"{before['size']} unchanged, etag {before['ETag'].strip(chr(34))} -> "
        f"{after['ETag'].strip(chr(34))}): re-index"
    )
    row = next(i for i, s in enumerate(table.sources) if s.endswith("shard-001.tar"))
    with pytest.raises(SampleError, match="changed since it was indexed") as err:
        make_packer(str(index))([], [row])
    assert str(err.value).startswith(changed) and err.value.key == table.keys[row]

    skipped = tmp_path / "skipped.jsonl"
    mbs = _serve(index, tmp_path, global_batch=8, on_error="skip", skipped=str(skipped))
    lost = [json.loads(line) for line in skipped.read_text().splitlines()]
    gone = {str(k) for k, s in zip(table.keys, table.sources) if s.endswith("shard-001.tar")}
    assert {r["key"] for r in lost} == gone and all(changed in r["reason"] for r in lost)
    assert sorted(k for m in mbs for k in m.llm_keys) == sorted(set(table.keys) - gone)

    old = tmp_path / "old.parquet"  # no identities, schema version 1
    arrow = pq.read_table(index)
    meta = {k: v for k, v in arrow.schema.metadata.items() if k != b"entrain_data.source_identity"}
    meta[b"entrain_data.index_schema_version"] = b"1"
    pq.write_table(arrow.replace_schema_metadata(meta), old)
    out = make_packer(str(old))([], [row])
    assert out.llm_keys == [table.keys[row]] and not out.skipped
