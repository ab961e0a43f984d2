"""Every input a user brings, indexed and then served: Parquet as indexed, loose files.

Real files from ../shared/data: the img2dataset caption tables (with their malformed row), COCO
images with captions, the dlinputs ImageNet folder, LibriSpeech clips with transcripts. Served
end to end through the loader service to two ranks: every sample exactly once.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_client import demo_plan

from entrain_data.cli import main
from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import read_index, write_index

pytestmark = [pytest.mark.timeout(180), pytest.mark.shared_data]


def serve_two_ranks(index, tmp_path, *, global_batch: int | None = None, microbatches: int = 2):
    """Every microbatch of one epoch, both ranks (a plan for the demo model: vision + audio)."""
    n = len(read_index(index))
    plan = demo_plan(dp=2, microbatches=microbatches, global_batch=global_batch or n)
    with EntrainLoader.local(
        rank=0,
        index=index,
        plan=plan,
        workers=2,
        timeout=120,
        socket_dir=str(tmp_path / "entrain-s"),
    ) as r0:
        r1 = EntrainLoader(r0.endpoint, 1, timeout=120)
        try:
            mbs = [m for pair in zip(r0, r1) for m in pair]
        finally:
            r1.close()
    assert not (tmp_path / "entrain-s").exists()
    return mbs


def assert_exactly_once(mbs, index) -> None:
    keys = sorted(read_index(index).keys)
    assert sorted(k for m in mbs for k in m.encoder_keys) == keys
    assert sorted(k for m in mbs for k in m.llm_keys) == keys


def test_parquet_column_mapping_is_stored_and_served(tmp_path, shared_data, capsys):
    table = shared_data / "parquet_captions" / "test_1000.parquet"
    index = tmp_path / "index.parquet"
    assert main(["index", str(table), "--column", "text=TEXT", "-o", str(index), "-q"]) == 0
    assert capsys.readouterr().out == ""  # -q: nothing on success
    t = read_index(index)
    assert t.column_map == {"text": "TEXT"}
    mbs = serve_two_ranks(index, tmp_path, global_batch=500)
    assert_exactly_once(mbs, index)
    # each packed sequence is BOS + the TEXT column's UTF-8 bytes + EOS, as indexed
    lens = {
        k: int(b - a)
        for m in mbs
        for k, a, b in zip(m.llm_keys, m["cu_seqlens"], m["cu_seqlens"][1:])
    }
    texts = pq.read_table(table, columns=["TEXT"]).column("TEXT").to_pylist()
    for i, key in enumerate(t.keys):
        assert lens[key] == len(texts[i].encode()) + 2 == t.text_tokens[i]


def test_same_named_tables_in_two_folders_are_keyed_apart_and_served(tmp_path):
    """``en/train-0.parquet`` and ``de/train-0.parquet`` without a key column: both were keyed
    ``train-0.parquet:<row>`` and the index refused the duplicates."""
    texts = {"en": ["a"] * 6, "de": ["bb" * 20] * 6}  # another length per folder
    for lang, rows in texts.items():
        (tmp_path / lang).mkdir()
        pq.write_table(pa.table({"text": rows}), tmp_path / lang / "train-0.parquet")
    index = tmp_path / "index.parquet"
    tables = [str(tmp_path / lang / "train-0.parquet") for lang in texts]
    assert main(["index", *tables, "-o", str(index), "-q"]) == 0
    keys = sorted(read_index(index).keys)
    assert keys == sorted(f"{lang}/train-0.parquet:{i}" for lang in texts for i in range(6))
    mbs = serve_two_ranks(index, tmp_path, global_batch=12)
    assert_exactly_once(mbs, index)
    for m in mbs:  # each key's sequence is its own table's text (BOS + bytes + EOS)
        for k, a, b in zip(m.llm_keys, m["cu_seqlens"], m["cu_seqlens"][1:]):
            assert int(b - a) == len(texts[k.split("/")[0]][0]) + 2, k


def test_a_table_beside_colliding_shards_keeps_the_keys_it_had():
    """Rows keyed by their table's name take a path only where table names collide: a rebuilt
    index of shards in two folders plus one table keeps its keys (and data fingerprint)."""
    from entrain_data.workers.index_keys import unique_keys as _unique_keys

    from entrain_data.metadata import SampleMeta

    recs = [
        SampleMeta("x", "/data/a/000.tar", 1, member="x"),
        SampleMeta("x", "/data/b/000.tar", 1, member="x"),
        SampleMeta("t.parquet:0", "/other/t.parquet", 1, row=0),
    ]
    assert [r.key for r in _unique_keys(recs)] == ["a/000.tar:x", "b/000.tar:x", "t.parquet:0"]


def test_parquet_malformed_row_is_indexed_and_packed(tmp_path, shared_data):
    from entrain_data.workers.index_builder import build_index
    from entrain_data.workers.packing import make_packer
    from entrain_data.workers.tokenizer import BYTE_OFFSET

    table = shared_data / "parquet_captions" / "test_10000.parquet"
    index = tmp_path / "index.parquet"
    write_index(build_index(str(table), progress=False, parquet_columns={"text": "TEXT"}), index)
    urls = pq.read_table(table, columns=["URL"]).column("URL").to_pylist()
    row = urls.index("UNLIKELY")  # the table's one malformed row: its TEXT is a number
    packer = make_packer(str(index))  # no columns given: the index's mapping is used
    try:
        packed = packer([row], [row])
    finally:
        packer.close()
    ids = packed.tensors["input_ids"]
    assert bytes((ids[1:-1] - BYTE_OFFSET).astype(np.uint8)) == b"0.32893747091293335"


def _coco(shared_data, n: int):
    rows = [json.loads(x) for x in (shared_data / "coco_mini" / "captions.jsonl").open()]
    return [(shared_data / "coco_mini" / r["path"], r) for r in rows[:n]]


def test_parquet_image_and_audio_bytes_are_served(tmp_path, shared_data):
    from entrain_data.workers.index_builder import build_index

    images = _coco(shared_data, 6)
    wavs = sorted((shared_data / "audio_misc" / "ljspeech" / "wavs").glob("*.wav"))[:3]
    assert len(wavs) == 3
    rows = [
        {"caption": r["captions"][0], "image": p.read_bytes(), "audio": None} for p, r in images
    ] + [{"caption": f"clip {w.stem}", "image": None, "audio": w.read_bytes()} for w in wavs]
    path = tmp_path / "media.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    index = tmp_path / "index.parquet"
    cols = {"text": "caption", "image": "image", "audio": "audio"}
    write_index(build_index(str(path), progress=False, parquet_columns=cols), index)
    t = read_index(index)
    assert t.column_map == cols
    assert [(int(h), int(w)) for h, w in zip(t.image_height, t.image_width)] == [
        (r["height"], r["width"]) for _, r in images
    ]
    mbs = serve_two_ranks(index, tmp_path)
    assert_exactly_once(mbs, index)
    grids = [g for m in mbs if "image_grid_thw" in m for g in m["image_grid_thw"].tolist()]
    clips = sum(len(m["audio_lengths"]) for m in mbs if "audio_lengths" in m)
    assert len(grids) == 6 and clips == 3


def test_loose_files_dlinputs_served(tmp_path, shared_data, capsys):
    folder = shared_data / "webdataset_testdata" / "dlinputs" / "dirdata"
    index = tmp_path / "index.parquet"
    assert main(["index", str(folder.parent), "-o", str(index), "-q"]) == 0
    t = read_index(index)
    pngs = sorted(p.stem for p in folder.glob("*.png"))
    assert sorted(t.keys) == [f"dirdata/{s}" for s in pngs] and len(pngs) == 6
    assert set(t.sources) == {str(folder.parent)}
    mbs = serve_two_ranks(index, tmp_path)
    assert_exactly_once(mbs, index)
    assert sum(len(m["image_grid_thw"]) for m in mbs if "image_grid_thw" in m) == 6


def test_loose_files_coco_with_sidecar_captions_served(tmp_path, shared_data):
    folder = tmp_path / "coco"
    (folder / "val").mkdir(parents=True)
    (folder / "README.md").write_text("not a sample")
    images = _coco(shared_data, 16)
    for i, (p, r) in enumerate(images):
        stem = folder / "val" / p.stem
        os.symlink(p, f"{stem}.jpg")
        if i % 2:  # name.json: a conversation; name.txt: a caption
            turns = [
                {"from": "human", "value": "Describe."},
                {"from": "gpt", "value": r["captions"][0]},
            ]
            (folder / "val" / f"{p.stem}.json").write_text(json.dumps({"conversations": turns}))
        else:
            (folder / "val" / f"{p.stem}.txt").write_text(r["captions"][0])
    index = tmp_path / "index.parquet"
    assert main(["index", str(folder), "-o", str(index), "-q"]) == 0
    t = read_index(index)
    assert sorted(t.keys) == sorted(f"val/{p.stem}" for p, _ in images)
    sizes = {f"val/{p.stem}": (r["height"], r["width"]) for p, r in images}
    for rec in t:
        assert (rec.images[0].height, rec.images[0].width) == sizes[rec.key]
    assert_exactly_once(serve_two_ranks(index, tmp_path, global_batch=8), index)


def test_loose_audio_with_transcripts_indexed(shared_data):
    from entrain_data.workers.index_builder import build_index

    t = build_index(str(shared_data / "audio_misc" / "librispeech_librosa"), progress=False)
    assert len(t) == 3 and len(t.audio_seconds) == 3 and np.all(t.audio_seconds > 1.0)
    assert np.all(t.text_tokens > 10)


def test_loose_images_without_text_name_the_file(tmp_path, shared_data):
    with pytest.raises(SampleError, match=r"000000000139.*no text member"):
        from entrain_data.workers.index_builder import build_index

        build_index(str(shared_data / "coco_mini" / "images"), progress=False)


def test_directory_source_groups_by_key(tmp_path):
    from entrain_data.workers.loose_files import DirectorySource
    from entrain_data.workers.sources import open_source

    (tmp_path / "a").mkdir()
    (tmp_path / ".hidden").mkdir()
    for name, data in {
        "a/x.seg.png": b"P",
        "a/x.txt": b"T",
        "a/y.txt": b"only text",
        "z.wav": b"W",
        "z.json": b"{}",
        "NOTES.md": b"",
        ".hidden/q.png": b"",
    }.items():
        (tmp_path / name).write_bytes(data)
    src = open_source(str(tmp_path))
    assert isinstance(src, DirectorySource)
    assert src.keys() == ["z", "a/x"] or src.keys() == ["a/x", "z"]
    assert src.passed_over == 2  # a/y (text only) and NOTES
    assert src.read("a/x") == {"seg.png": b"P", "txt": b"T"}
    assert src.read("z", ["wav"], limit=0) == {"wav": b""}
    with pytest.raises(SampleError, match="no files for key 'a/q'"):
        src.read("a/q")
    with pytest.raises(InvalidInput, match="not found"):
        from entrain_data.workers.sources import expand_paths

        expand_paths(str(tmp_path / "nope"))


def test_image_header_prefix_is_enough_for_every_coco_image(shared_data):
    from entrain_data.workers import decode

    for p, r in _coco(shared_data, 160):
        data = p.read_bytes()[: 1 << 16]
        assert decode.image_size(data) == (r["height"], r["width"]), p
    # a prefix that cuts the header short raises, so the index re-reads the whole image
    with pytest.raises(ValueError):
        decode.image_size(io.BytesIO(p.read_bytes()[:20]).getvalue())
