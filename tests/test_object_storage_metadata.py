"""A folder or an object-storage prefix read through the metadata file ``--metadata`` names.

``entrain-data index s3://bucket/prefix --metadata captions.jsonl`` indexes as its local copy
does: a real S3 API (moto's server mode on loopback, :mod:`_s3`), real encoded images made here.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import replace

import pytest
from _s3 import s3_server

from entrain_data.cli import main
from entrain_data.metadata import read_index

pytestmark = [pytest.mark.timeout(60)]

s3fs = pytest.importorskip("s3fs", reason="s3fs (test extra) not installed")
pytest.importorskip("moto.server", reason="moto[server] (test extra) not installed")

SIZES = {"images/0.png": (30, 40), "images/1.jpg": (64, 48), "images/sub/2.png": (17, 9)}


def _image(name: str, h: int, w: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    kind = "PNG" if name.endswith("png") else "JPEG"
    Image.new("RGB", (w, h), (h * 3 % 256, w, 90)).save(buf, kind)
    return buf.getvalue()


@pytest.fixture
def dataset(tmp_path):
    """A local folder (images, ``captions.jsonl`` naming them relative to it, a README, a shard)
    and its copy under ``s3://data/ds``; yields the local folder."""
    local = tmp_path / "ds"
    for name, (h, w) in SIZES.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(_image(name, h, w))
    recs = [{"file_name": n, "caption": f"picture {i}"} for i, n in enumerate(SIZES)]
    (local / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (local / "README.md").write_text("# three pictures\n")
    with tarfile.open(local / "older.tar", "w") as tar:  # a shard beside: --metadata reads past it
        info = tarfile.TarInfo("k.txt")
        tar.addfile(info, io.BytesIO(b""))
    with s3_server():
        fs = s3fs.S3FileSystem()
        fs.mkdir("data")
        fs.put(str(local), "data/ds", recursive=True)
        yield local


def _index(tmp_path, capsys, *inputs: str, metadata: str = "captions.jsonl"):
    out = tmp_path / "index.parquet"
    args = ["index", *inputs, "--metadata", metadata, "-o", str(out), "-q"]
    rc = main(args)
    return (read_index(out) if rc == 0 else None), rc, capsys.readouterr().err


@pytest.mark.parametrize("prefix", ["s3://data/ds", "s3://data/ds/"])
def test_prefix_through_its_metadata_file_indexes_as_the_local_folder(
    dataset, tmp_path, capsys, prefix
):
    from entrain_data.workers.sources import open_source

    remote, rc, err = _index(tmp_path, capsys, prefix)
    assert rc == 0, err
    local, rc, err = _index(tmp_path, capsys, str(dataset))
    assert rc == 0, err
    assert set(remote.sources) == {"s3://data/ds/captions.jsonl"}
    assert [str(k) for k in remote.keys] == [f"captions.jsonl:{i}" for i in (1, 2, 3)]
    assert [replace(r, source="") for r in remote] == [replace(r, source="") for r in local]
    assert [(m.images[0].height, m.images[0].width) for m in remote] == list(SIZES.values())
    src = open_source(remote.sources[0], metadata_columns=remote.column_map)
    for i, (member, name) in enumerate(zip(remote.members.tolist(), SIZES)):
        got = src.read(member)  # as a worker reads it: the record at its offset, the image
        assert got.pop("txt") == f"picture {i}".encode()
        assert list(got.values()) == [(dataset / name).read_bytes()], member


def test_missing_metadata_file_or_a_file_input_is_named(dataset, tmp_path, capsys):
    _, rc, err = _index(tmp_path, capsys, "s3://data/ds", metadata="nope.jsonl")
    assert rc == 2 and "metadata file not found: s3://data/ds/nope.jsonl" in err, err
    _, rc, err = _index(tmp_path, capsys, "s3://data/ds/captions.jsonl")
    assert rc == 2 and "s3://data/ds/captions.jsonl is a file" in err, err
    _, rc, err = _index(tmp_path, capsys, "s3://data/ds/*.jsonl")
    assert rc == 2 and "s3://data/ds/*.jsonl is a glob, which yields files" in err, err


def test_a_glob_matching_only_prefixes_stands_for_them(dataset, tmp_path, capsys):
    """``s3://bucket/parts/part-*`` over prefixes said "nothing matches" (a glob yielded
    objects only), where the same local glob over folders indexes each folder."""
    fs = s3fs.S3FileSystem()
    for i in range(2):
        fs.put(str(dataset), f"data/parts/part-{i}", recursive=True)
    fs.pipe_file("data/parts/README.md", b"two parts")  # beside the prefixes: not a shard
    table, rc, err = _index(tmp_path, capsys, "s3://data/parts/part-*")
    assert rc == 0, err
    assert sorted(set(table.sources)) == [
        f"s3://data/parts/part-{i}/captions.jsonl" for i in (0, 1)
    ]
    assert len(table) == 2 * len(SIZES)
