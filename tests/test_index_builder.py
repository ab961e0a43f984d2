"""Index builder: sizes from headers equal decoded sizes; bad samples raise naming shard and key."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from entrain_data.workers import decode
from entrain_data.workers.demo_data import write_demo_dataset
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.sources import TarShard
from entrain_data.workers.tokenizer import ByteTokenizer, count_text_tokens
from PIL import Image

from entrain_data.errors import InvalidInput, SampleError
from entrain_data.metadata import read_index, write_index


def write_shard(path: Path, samples: dict[str, dict[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def jpeg(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (90, 10, 200)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    return write_demo_dataset(d, samples=24, shards=2, seed=5)


def test_sizes_match_decoded(demo, tmp_path):
    table = build_index([str(p) for p in demo], progress=True)
    assert len(table) == 24
    tok = ByteTokenizer()
    shards = {str(p): TarShard(p) for p in demo}
    for rec in table:
        members = shards[rec.source].read(rec.member)
        imgs = sorted(e for e in members if decode.member_kind(e) == "image")
        auds = sorted(e for e in members if decode.member_kind(e) == "audio")
        assert len(imgs) == len(rec.images) and len(auds) == len(rec.audio_seconds)
        for ext, item in zip(imgs, rec.images):
            arr = decode.decode_image(members[ext])
            assert (item.frames, item.height, item.width) == (1, *arr.shape[:2])
        for ext, sec in zip(auds, rec.audio_seconds):
            wav, sr = sf.read(io.BytesIO(members[ext]))
            assert sec == pytest.approx(len(wav) / sr, abs=1e-5)
        assert rec.text_tokens == count_text_tokens(decode.text_segments(members), tok)
        assert rec.key == rec.member and rec.row == -1
    assert table.image_counts.max() >= 2 and len(table.audio_seconds) > 0
    assert (table.image_counts == 0).any()  # text-only samples exist
    write_index(table, tmp_path / "i.parquet")
    back = read_index(tmp_path / "i.parquet")
    assert list(back.keys) == list(table.keys)


def test_brace_pattern_and_hf_like_tokenizer(demo):
    class WordTok:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    pattern = str(demo[0].parent / "demo-{000..001}.tar")
    byte = build_index(pattern, progress=False)
    words = build_index(pattern, tokenizer=WordTok(), progress=False)
    assert len(byte) == len(words) == 24
    assert np.all(words.text_tokens < byte.text_tokens)  # ~ bytes per word fewer


def test_keys_repeated_across_shards_get_prefixed(tmp_path):
    a = write_shard(tmp_path / "a.tar", {"k1": {"txt": b"x"}, "k2": {"txt": b"y"}})
    b = write_shard(tmp_path / "b.tar", {"k1": {"txt": b"z"}})
    t = build_index([a, b], progress=False)
    assert sorted(t.keys) == ["a.tar:k1", "a.tar:k2", "b.tar:k1"]
    assert list(t.members) == ["k1", "k2", "k1"]


BAD = {
    "good": {"jpg": jpeg(40, 60), "txt": b"fine"},
    "notext": {"jpg": jpeg(40, 60)},
    "badimg": {"jpg": b"\xff\xd8\xff garbage", "txt": b"caption"},
    "badjson": {"json": b"{not json"},
    "badwav": {"wav": b"RIFF\x00\x00", "txt": b"t"},
    "good2": {"txt": b"also fine"},
}


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("notext", "no text member"),
        ("badimg", "not a readable image"),
        ("badjson", "not valid JSON"),
        ("badwav", "not a readable audio"),
    ],
)
def test_bad_sample_raises_naming_shard_and_key(tmp_path, key, match):
    path = write_shard(tmp_path / "bad.tar", {"good": BAD["good"], key: BAD[key]})
    with pytest.raises(SampleError, match=match) as err:
        build_index(path, progress=False)
    assert err.value.key == key and err.value.source == str(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_skip_records_bad_keys(tmp_path):
    path = write_shard(tmp_path / "bad.tar", BAD)
    skipped: list = []
    t = build_index(path, progress=False, on_error="skip", skipped=skipped)
    assert list(t.keys) == ["good", "good2"]
    assert sorted(s["key"] for s in skipped) == ["badimg", "badjson", "badwav", "notext"]
    assert all(s["source"] == str(path) for s in skipped)
    with pytest.raises(InvalidInput):
        build_index(path, on_error="ignore")


def test_truncated_shard(tmp_path):
    samples = {f"k{i}": {"txt": b"word " * 200} for i in range(10)}
    path = write_shard(tmp_path / "t.tar", samples)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2 + 100])
    with pytest.raises(SampleError, match="cut off") as err:
        build_index(path, progress=False)
    assert err.value.source == str(path) and err.value.key in samples
    skipped: list = []
    t = build_index(path, progress=False, on_error="skip", skipped=skipped)
    assert [s["key"] for s in skipped] == [err.value.key]
    assert 0 < len(t) < 10


def test_parquet_columns(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b", "c"],
                "caption": ["hello", "two images", "audio"],
                "h": [[100], [30, 40], []],
                "w": [[200], [50, 60], []],
                "dur": [[], [], [2.5]],
            }
        ),
        path,
    )
    cols = {
        "key": "id",
        "text": "caption",
        "image_height": "h",
        "image_width": "w",
        "audio_seconds": "dur",
    }
    t = build_index(path, parquet_columns=cols, progress=False)
    assert list(t.keys) == ["a", "b", "c"] and list(t.rows) == [0, 1, 2]
    assert list(t.image_height) == [100, 30, 40] and list(t.image_width) == [200, 50, 60]
    assert list(t.audio_seconds) == [2.5]
    assert list(t.text_tokens) == [5 + 2, 10 + 2, 5 + 2]
    with pytest.raises(InvalidInput, match="nope"):
        build_index(path, parquet_columns={"text": "nope"}, progress=False)


def test_real_shards(shared_data, tmp_path):
    d = shared_data / "webdataset_testdata"
    t = build_index([d / "sample.tgz", d / "testgz.tar", d / "compressed.tar"], progress=False)
    assert len(t) == 90 + 1000 + 3
    mnist = t.take(np.flatnonzero(t.sources == str(d / "sample.tgz")))
    assert set(mnist.image_height) == {28} and set(mnist.image_width) == {28}
    assert set(mnist.text_tokens) == {3}  # one digit + BOS + EOS
    comp = t.take(np.flatnonzero(t.sources == str(d / "compressed.tar")))
    assert list(comp.text_tokens) == [6 + 2, 6 + 2, 5 + 2]  # hello\n world\n gzip\n
    stats = json.loads((d / "STATS.json").read_text())
    assert stats["archives"]["testgz.tar"]["samples"] == 1000


def test_real_images_and_broken_ones(shared_data, tmp_path):
    misc = shared_data / "images_misc"
    good = sorted((misc / "img2dataset").glob("*.jpg"))
    samples = {p.stem: {"jpg": p.read_bytes(), "txt": b"x"} for p in good}
    broken = sorted((misc / "broken").iterdir())
    for p in broken:
        samples[f"broken_{p.stem}"] = {p.suffix[1:]: p.read_bytes(), "txt": b"x"}
    path = write_shard(tmp_path / "img.tar", samples)
    skipped: list = []
    t = build_index(path, progress=False, on_error="skip", skipped=skipped)
    for rec in t:
        if not rec.key.startswith("broken_"):
            arr = decode.decode_image(samples[rec.key]["jpg"])
            assert (rec.images[0].height, rec.images[0].width) == arr.shape[:2]
    assert all(s["key"].startswith("broken_") for s in skipped)
    assert any(s["key"] == "broken_zero_width" for s in skipped)


def test_wav_edge_cases(shared_data, tmp_path):
    wavs = sorted((shared_data / "audio_misc" / "wav_edge_cases").glob("*.wav"))
    samples = {p.stem: {"wav": p.read_bytes(), "txt": b"t"} for p in wavs}
    path = write_shard(tmp_path / "wav.tar", samples)
    skipped: list = []
    t = build_index(path, progress=False, on_error="skip", skipped=skipped)
    assert len(t) + len(skipped) == len(wavs) and len(t) > 0
    for rec in t:
        data = samples[rec.key]["wav"]
        try:
            info = sf.info(io.BytesIO(data))
            want = info.frames / info.samplerate
        except Exception:
            import wave

            with wave.open(io.BytesIO(data)) as w:
                want = w.getnframes() / w.getframerate()
        assert rec.audio_seconds[0] == pytest.approx(want, rel=1e-6)
    for s in skipped:
        assert s["key"] in samples and "audio" in s["error"]


def test_unreadable_shard_raises_or_is_skipped(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar at all" * 100)
    good = write_shard(tmp_path / "good.tar", {"k": {"txt": b"x"}})
    with pytest.raises(SampleError) as err:
        build_index([good, bad], progress=False)
    assert err.value.source == str(bad)
    skipped: list = []
    t = build_index([good, bad], progress=False, on_error="skip", skipped=skipped)
    assert list(t.keys) == ["k"] and skipped[0]["source"] == str(bad)


def test_real_audio_formats(shared_data, tmp_path):
    root = shared_data / "audio_misc"
    manifest = {}
    for line in (root / "manifest.jsonl").read_text().splitlines():
        rec = json.loads(line)
        manifest[rec["path"]] = rec.get("soundfile") or {}
    files = [
        "hf_datasets/test_audio_16000.mp3",
        "hf_datasets/test_audio_48000.opus",
        "whisper/jfk.flac",
        "librispeech_librosa/198-209-0000.ogg",
        "hf_datasets/test_audio_44100.wav",
    ]
    samples = {
        f"a{i}": {Path(f).suffix[1:]: (root / f).read_bytes(), "txt": b"t"}
        for i, f in enumerate(files)
    }
    t = build_index(write_shard(tmp_path / "a.tar", samples), progress=False)
    for i, f in enumerate(files):
        want = manifest[f]["frames"] / manifest[f]["samplerate"]
        assert t.record(i).audio_seconds[0] == pytest.approx(want, rel=1e-5), f
