"""Media named by a metadata file (ImageFolder's metadata.jsonl, LLaVA / ShareGPT JSON), served.

Real files from ../shared/data: coco_mini as shipped (``images/*.jpg`` + ``captions.jsonl``) and
LLaMA-Factory's ``mllm_demo`` JSON files (images, audio, video). Indexed through the CLI, served
through ``EntrainLoader.local`` to two ranks: every sample exactly once, placeholder and sequence
token counts equal to the cost model's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from entrain_data.workers.index_builder import build_index
from test_client import demo_plan
from test_inputs_served import assert_exactly_once, serve_two_ranks

from entrain_data.cli import main
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import read_index

pytestmark = [pytest.mark.timeout(180)]


def assert_costs_served(mbs, index) -> None:
    """Per sample: vision/audio placeholders and sequence length equal the cost model's."""
    table = read_index(index)
    costs = per_sample_costs(table, demo_plan().model_spec())
    row = {str(k): i for i, k in enumerate(table.keys)}
    for mb in mbs:
        t = mb.tensors
        lens = np.diff(t["cu_seqlens"].numpy())
        for i, k in enumerate(mb.llm_keys):
            assert int(t["llm_vision_tokens"][i]) == costs.vision_tokens[row[k]], k
            assert int(t["llm_audio_tokens"][i]) == costs.audio_tokens[row[k]], k
            assert int(lens[i]) == costs.llm_tokens[row[k]], k


@pytest.mark.shared_data
def test_coco_mini_as_shipped_served(tmp_path, shared_data, capsys):
    coco = shared_data / "coco_mini"
    index = tmp_path / "index.parquet"
    args = ["index", str(coco), "--metadata", "captions.jsonl", "--column", "text=captions"]
    assert main([*args, "--column", "image=path", "-o", str(index), "-q"]) == 0
    assert capsys.readouterr().out == ""  # -q: quiet
    t = read_index(index)
    recs = [json.loads(line) for line in (coco / "captions.jsonl").read_text().splitlines()]
    assert len(t) == len(recs) == 160 and t.column_map == {"text": "captions", "image": "path"}
    for rec, meta in zip(recs, t):  # sizes from the headers, first caption as text (+BOS/EOS)
        assert (meta.images[0].height, meta.images[0].width) == (rec["height"], rec["width"])
        assert meta.text_tokens == len(rec["captions"][0].encode()) + 2
    small = tmp_path / "small.parquet"  # serve a slice: the same records, fewer decodes
    from entrain_data.metadata import write_index

    write_index(t.take(range(24)), small)
    mbs = serve_two_ranks(small, tmp_path, global_batch=12)
    assert_exactly_once(mbs, small)
    assert_costs_served(mbs, small)


@pytest.mark.shared_data
def test_captions_each_is_one_sample_per_caption(shared_data):
    coco = shared_data / "coco_mini"
    cols = {"text": "captions", "image": "path"}
    t = build_index(
        str(coco), metadata="captions.jsonl", parquet_columns=cols, captions="each", progress=False
    )
    recs = [json.loads(line) for line in (coco / "captions.jsonl").read_text().splitlines()]
    first = recs[0]
    assert len(t) == sum(len(r["captions"]) for r in recs) > 5 * 160  # one has six
    assert [str(k) for k in t.keys[:5]] == [f"captions.jsonl:1#{i}" for i in range(5)]
    assert [int(n) for n in t.text_tokens[:5]] == [len(c.encode()) + 2 for c in first["captions"]]


@pytest.mark.shared_data
@pytest.mark.parametrize(
    "name, images, clips, audio",
    [
        ("mllm_demo.json", 8, 0, 0),
        ("mllm_audio_demo.json", 0, 0, 3),
        pytest.param("mllm_video_demo.json", 0, 3, 0, marks=pytest.mark.slow),  # ~5 s each
        pytest.param("mllm_video_audio_demo.json", 0, 3, 3, marks=pytest.mark.slow),
    ],
)
def test_mllm_demo_sharegpt_served(tmp_path, shared_data, name, images, clips, audio):
    index = tmp_path / "index.parquet"
    assert main(["index", str(shared_data / "mllm_demo" / name), "-o", str(index), "-q"]) == 0
    t = read_index(index)
    assert int((t.image_frames == 1).sum()) == images and int((t.image_frames > 1).sum()) == clips
    assert len(t.audio_seconds) == audio
    mbs = serve_two_ranks(index, tmp_path, global_batch=len(t), microbatches=1)
    assert_exactly_once(mbs, index)
    assert_costs_served(mbs, index)


def _folder(tmp_path, lines: list[str], name: str = "metadata.jsonl"):
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "a.png")
    (tmp_path / name).write_text("\n".join(lines) + "\n")
    return tmp_path


def test_imagefolder_metadata_jsonl_found_by_name(tmp_path):
    rec = {"file_name": "a.png", "text": "a red square"}
    t = build_index(str(_folder(tmp_path, [json.dumps(rec)])), progress=False)
    assert list(t.keys) == ["metadata.jsonl:1"] and t.record(0).images[0].height == 30
    assert t.column_map == {"text": "text", "media": "file_name"}


def test_imagefolder_metadata_csv(tmp_path):
    folder = _folder(tmp_path, ["file_name,caption,id", 'a.png,"red, square",x7'], "metadata.csv")
    t = build_index(str(folder), parquet_columns={"key": "id"}, progress=False)
    assert list(t.keys) == ["x7"] and int(t.text_tokens[0]) == len("red, square") + 2


def test_bad_record_names_file_and_line(tmp_path):
    good = json.dumps({"file_name": "a.png", "text": "ok"})
    missing = json.dumps({"file_name": "nope.png", "text": "gone"})
    folder = _folder(tmp_path, [good, "", missing])
    with pytest.raises(SampleError, match=r"metadata.jsonl:3: cannot read .*nope.png"):
        build_index(str(folder), progress=False)
    skipped: list[dict[str, str]] = []
    t = build_index(str(folder), on_error="skip", skipped=skipped, progress=False)
    assert len(t) == 1 and [s["key"] for s in skipped] == ["metadata.jsonl:3"]
    (tmp_path / "metadata.jsonl").write_text(good + "\n{not json\n")
    with pytest.raises(InvalidInput, match=r"metadata.jsonl:2: not valid JSON"):
        build_index(str(folder), progress=False)


def test_json_array_record_names_its_line(tmp_path):
    recs = [{"messages": [{"role": "user", "content": "<image>hi"}], "images": ["a.png"]}] * 2
    recs.append({"messages": "not a list", "images": [7]})
    folder = _folder(tmp_path, [json.dumps(recs, indent=1)], "llava.json")
    text = json.dumps(recs, indent=1).splitlines()
    line = [i for i, s in enumerate(text, 1) if s == " {"][2]  # where record 3 starts
    with pytest.raises(SampleError, match=rf"llava.json:{line}: field 'images' item 0 is a int"):
        build_index(str(folder / "llava.json"), progress=False)


def test_unknown_field_is_named(tmp_path):
    folder = _folder(tmp_path, [json.dumps({"file_name": "a.png", "text": "t"})])
    with pytest.raises(InvalidInput, match=r"field 'caption' \(for 'text'\) is in no record"):
        build_index(str(folder), parquet_columns={"text": "caption"}, progress=False)


@pytest.mark.shared_data
def test_coco_mini_hints_name_the_metadata_file_and_the_path_field(shared_data):
    coco = shared_data / "coco_mini"
    with pytest.raises(SampleError, match=r"no text member.*--metadata captions.jsonl"):
        build_index(str(coco), progress=False)
    with pytest.raises(SampleError, match=r"captions.jsonl:1: cannot read .*--column media=path"):
        build_index(
            str(coco),
            metadata="captions.jsonl",
            parquet_columns={"text": "captions"},
            progress=False,
        )


@pytest.mark.parametrize("name", ["llava.json", "meta.jsonl"])
def test_workers_read_one_record_at_its_offset(tmp_path, name):
    from entrain_data.workers.metadata_source import MetadataSource

    recs = [
        {"image": "a.png", "conversations": [{"from": "human", "value": f"été {i} <image>"}]}
        for i in range(5)
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in recs]
    body = ["[\n" + ",\n".join(lines) + "\n]"] if name.endswith(".json") else lines
    _folder(tmp_path, body, name)
    eager = MetadataSource(tmp_path / name)
    lazy = MetadataSource(tmp_path / name, eager.columns, lazy=True)
    members = eager.keys()
    first = 2 if name.endswith(".json") else 1  # the line where each record starts
    assert [eager.line(m) for m in members] == list(range(first, first + 5))
    assert all("@" in m for m in members)  # record@line:byte offset
    for m in reversed(members):
        assert lazy.read(m) == eager.read(m) and lazy.line(m) == eager.line(m)
    assert lazy._records is None  # nothing parsed but the records asked for


def test_imagefolder_metadata_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from entrain_data.workers.metadata_source import MetadataSource

    _folder(tmp_path, [])
    (tmp_path / "metadata.jsonl").unlink()
    rows = [{"file_name": "a.png", "caption": "red"}, {"file_name": "a.png", "caption": "again"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "metadata.parquet")
    t = build_index(str(tmp_path), progress=False)
    assert list(t.keys) == ["metadata.parquet:1", "metadata.parquet:2"]  # rows from 1
    assert [int(n) for n in t.text_tokens] == [5, 7]
    served = MetadataSource(tmp_path / "metadata.parquet", t.column_map, lazy=True)
    assert served.read(str(t.members[1]), ["txt"]) == {"txt": b"again"}


def test_a_parquet_metadata_file_named_otherwise_is_indexed_and_served_as_one(tmp_path):
    """``--metadata records.parquet`` was indexed as a Parquet table (only a file named
    ``metadata.parquet`` counted as metadata): no image, the caption column unknown."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from entrain_data.workers.packing import make_packer

    from entrain_data.metadata import write_index

    _folder(tmp_path, [])
    (tmp_path / "metadata.jsonl").unlink()
    rows = [{"file_name": "a.png", "caption": "red"}, {"file_name": "a.png", "caption": "again"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "records.parquet")
    t = build_index(str(tmp_path), metadata="records.parquet", progress=False)
    assert list(t.keys) == ["records.parquet:1", "records.parquet:2"]
    assert [len(t.record(i).images) for i in range(2)] == [1, 1]
    write_index(t, tmp_path / "index.parquet")
    packer = make_packer(str(tmp_path / "index.parquet"))
    try:
        packed = packer([0, 1], [0, 1])
    finally:
        packer.close()
    assert packed.encoder_keys == ["records.parquet:1", "records.parquet:2"]
    assert packed.tensors["pixel_values"].shape[0] > 0
