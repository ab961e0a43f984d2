"""What a user's inputs mean, read the way they were written: fields mapped from every record,
conversations counted as trained, captions once, durations on the sample grid, and refusals
that name the field, sample or cause (each failed before the fix that came with it)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from entrain_data.workers import decode
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.packing import make_packer
from entrain_data.workers.parquet_source import row_members
from entrain_data.workers.sample_source import DatasetSource
from entrain_data.workers.tokenizer import ByteTokenizer, sample_text_ids
from entrain_data.workers.transforms import AudioTransform
from PIL import Image
from test_index_builder import jpeg, write_shard

from entrain_data.dataset_profile import table_from_sizes
from entrain_data.errors import InvalidInput, PlanError, SampleError
from entrain_data.metadata import write_index
from entrain_data.presets import load_module
from entrain_data.tokens import audio_tokens


def _png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(round(seconds * 16000)), np.float32), 16000, format="WAV")
    return buf.getvalue()


def test_media_fields_are_mapped_from_every_record(tmp_path):
    """A ShareGPT mix whose first record is text-only still indexes the images and audio of the
    later ones (the fields were mapped from the first record alone, and the media dropped)."""
    (tmp_path / "a.png").write_bytes(_png(30, 40))
    (tmp_path / "a.wav").write_bytes(_wav(2.0))
    recs = [
        {"text": "no media"},
        {"text": "<image> a picture", "images": ["a.png"]},
        {"text": "a sound", "audios": ["a.wav"]},
    ]
    (tmp_path / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = build_index(str(tmp_path / "mix.jsonl"), progress=False)
    assert [len(t.record(i).images) for i in range(3)] == [0, 1, 0]
    assert [len(t.record(i).audio_seconds) for i in range(3)] == [0, 0, 1]
    assert t.column_map == {"text": "text", "image": "images", "audio": "audios"}
    # an explicit mapping to a field only later records hold is taken, not refused
    t2 = build_index(str(tmp_path / "mix.jsonl"), parquet_columns={"image": "images"})
    assert [len(t2.record(i).images) for i in range(3)] == [0, 1, 0]


def test_parquet_conversation_is_counted_as_the_packer_renders_it(tmp_path):
    conv = [
        {"role": "user", "content": "<image>What is this?"},
        {"role": "assistant", "content": "A grey square."},
    ]
    path = tmp_path / "conv.parquet"
    pq.write_table(pa.table({"messages": [conv], "image": [_png(40, 40)]}), path)
    cols = {"text": "messages", "image": "image"}
    t = build_index(str(path), parquet_columns=cols, progress=False)
    members = row_members(pq.read_table(path).to_pylist()[0], cols)
    ids, _ = sample_text_ids(decode.text_segments(members), ByteTokenizer())
    assert int(t.text_tokens[0]) == len(ids)  # was the length of the list's Python repr


def test_img2dataset_caption_beside_its_metadata_json_is_trained_once(tmp_path):
    """img2dataset / LAION shards: ``.txt`` the caption, ``.json`` metadata repeating it."""
    meta = json.dumps({"caption": "a red cat", "url": "http://x", "width": 40}).encode()
    shard = write_shard(
        tmp_path / "000.tar", {"k": {"jpg": jpeg(30, 40), "txt": b"a red cat", "json": meta}}
    )
    t = build_index(str(shard), progress=False)
    segs = decode.text_segments({"txt": b"a red cat", "json": meta})
    assert "".join(s.text for s in segs) == "a red cat"
    assert int(t.text_tokens[0]) == len(sample_text_ids(segs, ByteTokenizer())[0])
    # a conversation in the .json is still the sample's text, beside a .txt as well
    conv = json.dumps([{"from": "human", "value": "hi"}]).encode()
    assert len(decode.text_segments({"txt": b"x", "json": conv})) == 2


def test_shards_of_one_name_in_two_folders_index_together(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        write_shard(tmp_path / d / "000.tar", {"k": {"jpg": jpeg(8, 8), "txt": d.encode()}})
    t = build_index([str(tmp_path / "a" / "000.tar"), str(tmp_path / "b" / "000.tar")])
    assert sorted(map(str, t.keys)) == ["a/000.tar:k", "b/000.tar:k"]
    # distinct shard names keep the short keys of before
    write_shard(tmp_path / "a" / "001.tar", {"k": {"jpg": jpeg(8, 8), "txt": b"c"}})
    t2 = build_index([str(tmp_path / "a" / "000.tar"), str(tmp_path / "a" / "001.tar")])
    assert sorted(map(str, t2.keys)) == ["000.tar:k", "001.tar:k"]


def test_float32_durations_land_on_the_sample_grid():
    """3,200 samples at 16 kHz: 20 mel frames, 5 LLM tokens, from the float32 an index stores."""
    whisper = load_module("whisper-large-v3-encoder")
    stored = np.float32(3200 / 16000)
    assert float(stored) != 0.2
    assert AudioTransform(whisper).frames(float(stored)) == 20
    per_frame = whisper.audio_conv_stride * whisper.audio_pool
    assert int(audio_tokens(whisper, np.array([stored])).llm_tokens[0]) == 20 // per_frame


def test_audio_features_at_another_rate_are_refused_not_miscounted():
    """Frames and tokens are counted on the 16 kHz grid: an 8 kHz transform gave features of
    another hop than the counts the index priced (WhisperFeatureExtractor refuses it too)."""
    with pytest.raises(InvalidInput, match="sample_rate=8000.*16000 Hz"):
        AudioTransform(load_module("whisper-large-v3-encoder"), sample_rate=8000)


def test_parquet_index_of_sizes_alone_is_refused_at_serve_with_its_cause(tmp_path):
    path = tmp_path / "sizes.parquet"
    pq.write_table(pa.table({"text": ["a"], "h": [64], "w": [48]}), path)
    t = build_index(str(path), parquet_columns={"text": "text", "image_height": "h",
                                                "image_width": "w"})  # fmt: skip
    write_index(t, tmp_path / "index.parquet")
    with pytest.raises(InvalidInput, match="no image column to serve.*plans but cannot be served"):
        make_packer(str(tmp_path / "index.parquet"))


class _Items:
    """Item 2 lacks a field; item 4's ``__getitem__`` raises."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        import torch

        if i == 4:
            raise OSError("disk gone")
        d = {"ids": torch.full((3,), i)}
        if i != 2:
            d["pixels"] = torch.zeros(2, 2)
        return d


def test_dataset_items_that_fail_are_named_and_skipped():
    skip = DatasetSource(_Items(), None, on_error="skip").make_packer()
    packed = skip([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    assert packed.llm_keys == ["0", "1", "3", "5"] and packed.encoder_keys == packed.llm_keys
    assert [s["key"] for s in packed.skipped] == ["2", "4"]
    assert "dataset[2]" in packed.skipped[0]["error"] and "pixels" in packed.skipped[0]["error"]
    assert packed.tensors["ids"].shape == (4, 3)
    # the same decision for item 2 alone (its encoder set) as beside the others (its LLM set)
    assert skip([2], []).skipped[0]["key"] == "2" and skip([], [2]).llm_keys == []
    strict = DatasetSource(_Items(), None, on_error="raise").make_packer()
    with pytest.raises(SampleError, match=r"dataset\[2\]") as err:
        strict([0, 1, 2], [0, 1, 2])
    assert err.value.key == "2"
    with pytest.raises(SampleError, match=r"dataset\[4\]: OSError: disk gone"):
        strict([4], [4])


def test_sizes_fn_values_are_checked_and_named():
    def table(s):
        return table_from_sizes(2, lambda i: s if i == 1 else {"text_tokens": 3})

    t = table({"text_tokens": 5, "images": None, "audio_seconds": None})  # None: no items
    assert list(t.text_tokens) == [3, 5] and len(t.image_height) == 0
    for bad, why in (
        ({"text_tokens": 5.9}, "whole number"),
        ({"text_tokens": True}, "whole number"),
        ({"text_tokens": float("nan")}, "whole number"),
        ({"text_tokens": 5, "audio_seconds": 3.0}, "audio_seconds must be a list"),
        ({"text_tokens": 5, "images": [(0, 640)]}, "sizes must be >= 1"),
    ):
        with pytest.raises(InvalidInput, match=rf"^sizes_fn\(1\): .*{why}"):
            table(bad)


@pytest.mark.parametrize("field", ["audio_pool", "audio_conv_stride"])
def test_audio_divisors_must_be_positive(field):
    cfg = load_module("whisper-large-v3-encoder")
    from dataclasses import replace

    for v in (0, -2):
        with pytest.raises(InvalidInput, match=rf"field '{field}' must be a whole number >= 1"):
            replace(cfg, **{field: v})


def test_plan_names_a_batch_too_small_for_its_microbatches():
    from entrain_data.plan import Cluster
    from entrain_data.planner import make_plan
    from entrain_data.presets import ModelSpec

    model = ModelSpec(encoders=(load_module("qwen2.5-vl-vision"),), llm=load_module("llama-3.2-1b"))
    t = table_from_sizes(16, lambda i: {"text_tokens": 20 + i, "images": [(224, 224)]})
    with pytest.raises(PlanError, match=r"global batch 8 < dp 8 x microbatches 2"):
        make_plan(t, model, Cluster(8), 8, dp=8, microbatches=2)


@pytest.mark.parametrize("orientation", [2, 3, 5, 6, 7, 8])
def test_exif_rotated_photos_are_indexed_and_decoded_as_displayed(tmp_path, orientation):
    """Sizes and pixels as ``transformers``' ``load_image`` gives them (EXIF applied)."""
    load_image = pytest.importorskip("transformers.image_utils").load_image
    arr = np.zeros((200, 100, 3), np.uint8)
    arr[:20] = 255  # a white band at the stored top
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = orientation
    im.save(tmp_path / "p.jpg", "JPEG", exif=exif.tobytes())
    data = (tmp_path / "p.jpg").read_bytes()
    want = np.asarray(load_image(str(tmp_path / "p.jpg")))
    shard = write_shard(tmp_path / "000.tar", {"k": {"jpg": data, "txt": b"a photo"}})
    rec = build_index(str(shard), progress=False).record(0)
    assert (rec.images[0].height, rec.images[0].width) == want.shape[:2]
    np.testing.assert_array_equal(decode.decode_image(data), want)
    assert decode.decode_image(data, want.shape[:2], draft=True).shape == want.shape


def test_a_stray_field_in_one_record_does_not_remap_the_file(tmp_path):
    """One record with ``messages`` in a file of ``conversations``: the text is still read
    from ``conversations`` (the field most records hold)."""
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    recs = [{"conversations": conv}] * 3 + [{"messages": conv}]
    (tmp_path / "llava.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = build_index(str(tmp_path / "llava.jsonl"), on_error="skip", progress=False)
    assert t.column_map["text"] == "conversations" and len(t) == 3


def test_a_class_label_beside_a_caption_json_keeps_the_caption():
    meta = json.dumps({"caption": "a dog"}).encode()
    segs = decode.text_segments({"cls": b"7", "json": meta})
    assert "a dog" in "".join(s.text for s in segs)
