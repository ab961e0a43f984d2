"""Packing: tensors as batch.py names them, placeholders = encoder outputs = cost model tokens."""

from __future__ import annotations

import io
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from entrain_data.workers import decode, packing
from entrain_data.workers.demo_data import write_demo_dataset
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.packing import (
    EncoderInput,
    LLMInput,
    make_packer,
    pack_microbatch,
    resolve_encoders,
)
from entrain_data.workers.tokenizer import BYTE_OFFSET, ByteTokenizer
from entrain_data.workers.transforms import AudioTransform, VisionTransform

from entrain_data.batch import normalize_pixels
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import read_index, write_index
from entrain_data.presets import ModelSpec, load_module

# a light vision config so the tests stay fast: same geometry rules as the preset, smaller pages
VISION = replace(load_module("qwen2.5-vl-vision"), max_pixels=256 * 28 * 28)
AUDIO = load_module("whisper-large-v3-encoder")
MODEL = ModelSpec(encoders=(VISION, AUDIO), llm=load_module("llama-3.2-1b"))


def write_shard(path: Path, samples: dict[str, dict[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    paths = write_demo_dataset(d, samples=32, shards=2, seed=2)
    table = build_index([str(p) for p in paths], progress=False)
    return write_index(table, d / "index.parquet"), table


def _check_invariants(tensors, keys, llm_rows, table, packer):
    cu = tensors["cu_seqlens"]
    ids, labels, pos = tensors["input_ids"], tensors["labels"], tensors["position_ids"]
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == len(ids) == len(labels) == len(pos)
    assert len(cu) == len(keys) + 1 and np.all(np.diff(cu) > 0)
    costs = per_sample_costs(table.take(llm_rows), MODEL)
    tok = packer.tokenizer
    for i in range(len(keys)):
        a, b = int(cu[i]), int(cu[i + 1])
        seg, lab = ids[a:b], labels[a:b]
        assert np.array_equal(pos[a:b], np.arange(b - a))
        n_img = int((seg == tok.image_token_id).sum())
        n_aud = int((seg == tok.audio_token_id).sum())
        assert n_img == tensors["llm_vision_tokens"][i] == costs.vision_tokens[i]
        assert n_aud == tensors["llm_audio_tokens"][i] == costs.audio_tokens[i]
        assert b - a == costs.llm_tokens[i]  # the assignment's token cap sees the packed length
        assert lab[-1] == -100
        nxt = seg[1:]
        has = lab[:-1] != -100
        assert np.array_equal(lab[:-1][has], nxt[has])
        assert not np.any(np.isin(nxt[has], [tok.image_token_id, tok.audio_token_id]))


def test_full_pack_matches_cost_model_and_encoder(demo):
    index, table = demo
    packer = make_packer(str(index), model=MODEL.to_dict())
    rows = list(range(len(table)))
    out = packer(rows, rows)
    t = out.tensors
    assert out.encoder_keys == out.llm_keys == [str(k) for k in table.keys]
    _check_invariants(t, out.llm_keys, rows, table, packer)
    # vision: patches per item = t*h*w of its grid; encoder output after merging = placeholders
    grid = t["image_grid_thw"]
    # uint8 on the wire, one temporal copy; Microbatch.to fills the temporal patch as float32
    assert t["pixel_values"].dtype == np.uint8
    assert t["pixel_values"].shape == (int(grid.prod(axis=1).sum()), 3 * 14 * 14)
    dev = normalize_pixels(torch.from_numpy(t["pixel_values"]), out.meta, video=False)
    assert dev.dtype == torch.float32 and dev.shape == (len(t["pixel_values"]), 3 * 2 * 14 * 14)
    assert out.meta["patch_dim"] == 3 * 2 * 14 * 14 and out.meta["temporal_patch"] == 2
    merged = grid.prod(axis=1) // VISION.merge**2
    per_sample = np.bincount(t["image_sample"], weights=merged, minlength=len(rows))
    assert np.array_equal(per_sample.astype(np.int64), t["llm_vision_tokens"])
    assert np.all(grid[:, 1:] % VISION.merge == 0)
    # audio: frames per clip -> Qwen2-Audio's output length (conv stride 2, then pool 2; clips
    # under 30 s here) encoder outputs = placeholders
    lengths = t["audio_lengths"]
    assert t["audio_features"].shape == (int(lengths.sum()), AUDIO.n_mels) and lengths.max() <= 3000
    outs = ((lengths - 1) // AUDIO.audio_conv_stride + 1) // AUDIO.audio_pool
    per_sample = np.bincount(t["audio_sample"], weights=outs, minlength=len(rows))
    assert np.array_equal(per_sample.astype(np.int64), t["llm_audio_tokens"])
    assert np.isfinite(t["audio_features"]).all() and np.isfinite(t["pixel_values"]).all()
    assert out.meta["image_token_id"] == 1 and out.meta["audio_token_id"] == 2
    assert out.skipped == []


def test_deferred_llm_only_pack_decodes_nothing(demo, monkeypatch):
    index, table = demo
    packer = make_packer(str(index), model=MODEL)
    rows = list(range(12))
    full = packer(rows, rows)

    def boom(*a, **k):
        raise AssertionError("LLM-only packing decoded media")

    monkeypatch.setattr(decode, "decode_image", boom)
    monkeypatch.setattr(decode, "decode_audio", boom)
    llm_only = packer([], rows)
    assert llm_only.encoder_keys == [] and "pixel_values" not in llm_only.tensors
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "llm_vision_tokens"):
        assert np.array_equal(llm_only.tensors[name], full.tensors[name])


def test_split_sets_encoder_only_and_llm_only(demo):
    index, table = demo
    packer = make_packer(str(index), model=MODEL)
    out = packer([0, 1, 2, 3], [2, 3, 4])
    assert out.encoder_keys == [str(table.keys[r]) for r in (0, 1, 2, 3)]
    assert out.llm_keys == [str(table.keys[r]) for r in (2, 3, 4)]
    if "image_sample" in out.tensors:
        assert out.tensors["image_sample"].max() < 4
    _check_invariants(out.tensors, out.llm_keys, [2, 3, 4], table, packer)


def _bad_index(tmp_path, extra):
    good = (tmp_path / "g.jpg").parent
    buf = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (64, 48), (1, 2, 3)).save(buf, format="JPEG")
    samples = {"ok": {"jpg": buf.getvalue(), "txt": b"fine"}, **extra}
    path = write_shard(good / "b.tar", samples)
    table = build_index(path, progress=False)
    return write_index(table, tmp_path / "b.parquet"), path


def test_undecodable_image_raises_or_skips(tmp_path, shared_data):
    broken = (shared_data / "images_misc" / "broken" / "truncated_image.png").read_bytes()
    decode.image_size(broken)  # the header reads (so the index has it) ...
    index, shard = _bad_index(tmp_path, {"bad": {"png": broken, "txt": b"caption"}})
    packer = make_packer(str(index), model=MODEL)
    with pytest.raises(SampleError) as err:  # ... but the pixels do not decode
        packer([0, 1], [0, 1])
    assert err.value.key == "bad" and err.value.source == str(shard)
    assert "bad" in str(err.value) and str(shard) in str(err.value)
    skip = make_packer(str(index), model=MODEL, on_error="skip")
    out = skip([0, 1], [0, 1])
    assert out.encoder_keys == out.llm_keys == ["ok"]
    assert [s["key"] for s in out.skipped] == ["bad"]


def test_missing_text_member_at_pack_time(tmp_path):
    index, shard = _bad_index(tmp_path, {"t": {"txt": b"will vanish"}})
    # an index without source identities (written before they were recorded): the rewritten
    # shard is not refused up front (see test_source_identity), so its reads meet the change
    write_index(replace(read_index(index), source_identity={}), index)
    # rewrite the shard without the text member: the index is now stale
    with tarfile.open(shard) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    del members["t.txt"]
    members["t.cls"] = b"zz"
    shard.unlink()
    with tarfile.open(shard, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    packer = make_packer(str(index), model=MODEL)
    out = packer([], [1])  # a cls label counts as text: packs
    assert out.llm_keys == ["t"]
    members.pop("t.cls")
    shard.unlink()
    with tarfile.open(shard, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SampleError, match="no sample|no text") as err:
        make_packer(str(index), model=MODEL)([], [1])
    assert err.value.key == "t"


def test_pack_microbatch_pure():
    a = LLMInput("a", np.array([3, 10, 11, 4]), np.array([False, True, True, True]), (4,), ())
    b = LLMInput("b", np.array([3, 20, 4]), np.array([False, False, True]), (), (2,))
    enc = EncoderInput("a", (np.ones((16, 8), np.float32),), ((1, 4, 4),), ())
    t = pack_microbatch([enc], [a, b], image_token_id=1, audio_token_id=2)
    assert t["cu_seqlens"].tolist() == [0, 8, 13]
    assert t["input_ids"].tolist() == [3, 1, 1, 1, 1, 10, 11, 4, 3, 2, 2, 20, 4]
    assert t["labels"].tolist() == [
        -100,
        -100,
        -100,
        -100,
        10,
        11,
        4,
        -100,
        -100,
        -100,
        -100,
        4,
        -100,
    ]
    assert t["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4]
    assert t["llm_vision_tokens"].tolist() == [4, 0] and t["llm_audio_tokens"].tolist() == [0, 2]
    assert t["image_sample"].tolist() == [0] and "audio_features" not in t
    empty = pack_microbatch([], [], image_token_id=1, audio_token_id=2)
    assert empty["cu_seqlens"].tolist() == [0] and len(empty["input_ids"]) == 0


def test_patch_layout_is_qwen2vl():
    vt = VisionTransform(replace(VISION, patch_size=2, merge=2, temporal_patch=2))
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(8, 12, 3), dtype=np.uint8)
    raw, grid = vt.encode_image(img)
    assert grid == (1, 4, 6) and raw.shape == (24, 3 * 2 * 2) and raw.dtype == np.uint8
    meta = {"pixel_mean": VISION.image_mean, "pixel_std": VISION.image_std, "temporal_patch": 2}
    patches = normalize_pixels(torch.from_numpy(raw), meta, video=False).numpy()
    assert patches.shape == (24, 3 * 2 * 2 * 2)
    mean, std = np.array(VISION.image_mean), np.array(VISION.image_std)
    norm = ((img / 255.0 - mean) / std).astype(np.float32)
    k = 0
    for bh in range(2):  # merge windows are contiguous: (block row, block col, i, j)
        for bw in range(3):
            for i in range(2):
                for j in range(2):
                    r, c = bh * 2 + i, bw * 2 + j
                    want = norm[r * 2 : r * 2 + 2, c * 2 : c * 2 + 2].transpose(2, 0, 1)
                    got = patches[k].reshape(3, 2, 2, 2)
                    assert np.allclose(got[:, 0], want, atol=1e-5)
                    assert np.allclose(got[:, 1], want, atol=1e-5)  # still image: frame repeated
                    k += 1
    # a side that is no multiple of patch*merge: the remainder is dropped (as a strided conv)
    assert vt.encode_image(img[:7])[1] == (1, 2, 6)
    with pytest.raises(InvalidInput):
        vt.encode_image(img[:3])


def test_log_mel_features():
    at = AudioTransform(AUDIO)
    sr = 16000
    t = np.arange(int(2.5 * sr)) / sr
    low = at.features(np.sin(2 * np.pi * 300 * t).astype(np.float32), 2.5)
    high = at.features(np.sin(2 * np.pi * 3000 * t).astype(np.float32), 2.5)
    assert low.shape == (250, 128) == high.shape
    assert low.mean(axis=0).argmax() < high.mean(axis=0).argmax()
    for sec in (0.01, 1.0, 2.345, 12.34, 29.99, 30.0):
        sec32 = float(np.float32(sec))  # the index stores float32 seconds
        f = at.frames(sec32)  # Qwen2-Audio's output length (0.01 s: one frame, no token)
        assert (((f - 1) // 2 + 1) - 2) // 2 + 1 == at.llm_tokens(sec32)
    assert at.features(np.zeros(10, np.float32), 3.0).shape == (300, 128)


def test_tokenizer_and_encoder_resolution():
    tok = ByteTokenizer()
    assert tok.encode("hé").tolist() == [
        ord("h") + BYTE_OFFSET,
        0xC3 + BYTE_OFFSET,
        0xA9 + BYTE_OFFSET,
    ]
    v, a = resolve_encoders(None)
    assert (v.name, a.name) == (packing.DEFAULT_VISION, packing.DEFAULT_AUDIO)
    v, a = resolve_encoders(MODEL.to_dict())
    assert v.max_pixels == VISION.max_pixels
    VisionTransform(load_module("internvit-300m"))  # tiles: served since issue 14
    four = replace(VISION, in_channels=4, image_mean=(0.5,) * 4, image_std=(0.5,) * 4)
    with pytest.raises(InvalidInput, match="in_channels"):
        VisionTransform(four)


def test_user_transform_hook(demo):
    index, table = demo

    def shout(sample):
        segs = tuple(replace(s, text=s.text.upper()) for s in sample.segments)
        return replace(sample, segments=segs)

    plain = make_packer(str(index), model=MODEL)([], [0])
    loud = make_packer(str(index), model=MODEL, transform=shout)([], [0])
    assert len(plain.tensors["input_ids"]) == len(loud.tensors["input_ids"])
    assert not np.array_equal(plain.tensors["input_ids"], loud.tensors["input_ids"])


def test_skip_is_consistent_across_deferral(tmp_path, shared_data):
    """Encoded in one task, consumed in another: both drop a sample whose image fails."""
    broken = (shared_data / "images_misc" / "broken" / "truncated_image.png").read_bytes()
    index, _ = _bad_index(tmp_path, {"bad": {"png": broken, "txt": b"caption"}})
    enc_side = make_packer(str(index), model=MODEL, on_error="skip")([0, 1], [0])
    llm_side = make_packer(str(index), model=MODEL, on_error="skip")([], [1])
    assert [s["key"] for s in enc_side.skipped] == [s["key"] for s in llm_side.skipped] == ["bad"]
    assert llm_side.llm_keys == [] and enc_side.encoder_keys == ["ok"]
    # raise policy: an LLM-only pack does not decode media, so it cannot notice
    assert make_packer(str(index), model=MODEL)([], [1]).llm_keys == ["bad"]


def test_parquet_table_rows_pack_like_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    def png(h, w):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
        return buf.getvalue()

    wav = io.BytesIO()
    import soundfile as sf

    sf.write(wav, np.zeros(16000 * 2, np.float32), 16000, format="WAV")
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table(
            {
                "caption": ["one image", "two images", "a clip"],
                "images": [[png(60, 90)], [png(100, 40), png(30, 30)], []],
                "audio": [[], [], [wav.getvalue()]],
            }
        ),
        path,
        row_group_size=2,
    )
    cols = {"text": "caption", "image": "images", "audio": "audio"}
    table = build_index(path, parquet_columns=cols, progress=False)
    assert list(table.image_height) == [60, 100, 30] and list(table.image_width) == [90, 40, 30]
    assert list(table.audio_seconds) == [2.0]
    index = write_index(table, tmp_path / "i.parquet")
    packer = make_packer(str(index), model=MODEL, parquet_columns=cols)
    out = packer([0, 1, 2], [0, 1, 2])
    assert out.tensors["image_grid_thw"].shape == (3, 3) and out.tensors[
        "audio_lengths"
    ].tolist() == [200]
    _check_invariants(out.tensors, out.llm_keys, [0, 1, 2], table, packer)


def test_tokenizer_by_name_and_object(demo):
    from entrain_data.workers.tokenizer import HFTokenizer, as_tokenizer

    assert isinstance(as_tokenizer("byte"), ByteTokenizer)
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(InvalidInput, match="transformers"):
            as_tokenizer("gpt2")

    class Words:
        bos_token_id, eos_token_id, vocab_size = 7, 8, 1000

        def encode(self, text, add_special_tokens=True):
            return [10 + len(w) for w in text.split()]

    tok = as_tokenizer(Words())
    assert isinstance(tok, HFTokenizer) and (tok.image_token_id, tok.audio_token_id) == (1000, 1001)
    index, table = demo
    words_table = build_index(list(dict.fromkeys(table.sources)), tokenizer=Words(), progress=False)
    out = make_packer(str(index), model=MODEL, tokenizer=Words())([], [0, 1, 2])
    lens = np.diff(out.tensors["cu_seqlens"])
    costs = per_sample_costs(words_table.take([0, 1, 2]), MODEL)
    assert np.array_equal(lens, costs.llm_tokens)  # same tokenizer in index and packer: exact
    assert out.meta["image_token_id"] == 1000


def test_unservable_configuration_fails_at_construction(demo):
    """One InvalidInput line from the constructor (the service builds one before any worker)."""
    index, _ = demo
    four = replace(VISION, in_channels=4, image_mean=(0.5,) * 4, image_std=(0.5,) * 4)
    cases = [
        ({"vision": four}, "in_channels"),
        ({"vision": {**VISION.to_dict(), "resize_mode": "x"}}, "unknown field"),
        ({"vision": "no-such-encoder"}, "unknown model preset"),
        ({"audio": VISION}, "AudioTransform needs an audio module"),
        ({"vision": AUDIO}, "VisionTransform needs a vision module"),
        ({"on_error": "ignore"}, "on_error"),
    ]
    for kwargs, match in cases:
        with pytest.raises(InvalidInput, match=match) as exc:
            make_packer(str(index), **kwargs)
        assert "\n" not in str(exc.value)
    for preset in ("siglip-so400m", "internvit-300m", "qwen2.5-vl-vision-1280"):
        make_packer(str(index), vision=preset)  # every vision preset is served


def test_microbatch_to_normalises_uint8_pixels_only():
    from entrain_data.batch import Microbatch

    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(8, 3 * 4), dtype=np.uint8)  # p = 2, one temporal copy
    vid = rng.integers(0, 256, size=(4, 3 * 2 * 4), dtype=np.uint8)  # tp = 2 frames per row
    meta = {"pixel_mean": [0.5, 0.4, 0.3], "pixel_std": [0.2, 0.25, 0.5], "temporal_patch": 2}
    t = {"pixel_values": torch.from_numpy(raw), "pixel_values_videos": torch.from_numpy(vid)}
    mb = Microbatch(0, 0, 0, 0, ["a"], [], t, meta).to("cpu")
    mean, std = np.array(meta["pixel_mean"]), np.array(meta["pixel_std"])
    want = (raw.reshape(8, 3, 1, 4) / 255.0 - mean[:, None, None]) / std[:, None, None]
    got = mb["pixel_values"].numpy().reshape(8, 3, 2, 4)
    assert mb["pixel_values"].dtype == torch.float32
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), atol=1e-5)
    want_v = (vid.reshape(4, 3, 8) / 255.0 - mean[:, None]) / std[:, None]
    np.testing.assert_allclose(
        mb["pixel_values_videos"].numpy().reshape(4, 3, 8), want_v, atol=1e-5
    )
    floats = torch.rand(8, 24)  # float pixels (synthetic batches) pass through untouched
    same = Microbatch(0, 0, 0, 0, ["a"], [], {"pixel_values": floats}, {}).to("cpu")
    assert torch.equal(same["pixel_values"], floats)
    with pytest.raises(InvalidInput, match="pixel_mean"):
        Microbatch(0, 0, 0, 0, ["a"], [], {"pixel_values": torch.from_numpy(raw)}, {}).to("cpu")
