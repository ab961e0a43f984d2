"""Issue 14's must-show: real images, audio and video served end to end, per vision preset.

For each of ``siglip-so400m``, ``internvit-300m``, ``qwen2.5-vl-vision`` and
``qwen2.5-vl-vision-1280`` (with ``whisper-large-v3-encoder`` for the audio): a WebDataset shard of
real files from ../shared/data (COCO photos with captions, images with alpha/palette, speech clips,
the mllm_demo videos with their conversations) goes index -> plan -> ``start_service`` -> two
``EntrainLoader`` ranks. Every sample arrives exactly once; the placeholders of every sample equal
the cost model's tokens; after ``Microbatch.to`` every image's pixels equal the ``transformers``
processor's, every clip's features ``WhisperFeatureExtractor``'s, every video the Qwen2-VL video
pipeline's (see test_media_reference for what of it runs here).
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from entrain_data.workers import decode
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.service import start_service
from entrain_data.workers.transforms import AudioTransform
from test_media_reference import (
    meta_of,
    reference_image,
    reference_video,
    unpatchify,
)

from entrain_data.client import EntrainLoader
from entrain_data.cost_model import per_sample_costs
from entrain_data.metadata import write_index
from entrain_data.plan import Cluster
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec, load_module

pytestmark = [pytest.mark.shared_data, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")

MISC = (
    "images_misc/hf_datasets/test_image_rgba.png",
    "images_misc/pillow/hopper.gif",
    "images_misc/img2dataset/456_123.jpg",
)
AUDIO = ("mllm_demo/mllm_demo_data/2.wav", "audio_misc/whisper/jfk.flac")
VIDEOS = ("4.mp4", "2.avi")


def write_real_shard(root: Path, shared: Path, n_coco: int = 9) -> tuple[Path, dict[str, Path]]:
    """A tar shard of 16 real samples; returns it and key -> media file."""
    media: dict[str, Path] = {}
    samples: dict[str, dict[str, bytes]] = {}
    rows = [json.loads(x) for x in (shared / "coco_mini" / "captions.jsonl").open()][:n_coco]
    for r in rows:
        key = f"coco{r['image_id']:012d}"
        media[key] = shared / "coco_mini" / r["path"]
        samples[key] = {"jpg": media[key].read_bytes(), "txt": r["captions"][0].encode()}
    for i, rel in enumerate(MISC):
        key, ext = f"misc{i}", rel.rsplit(".", 1)[1]
        media[key] = shared / rel
        samples[key] = {ext: media[key].read_bytes(), "txt": f"picture {i}".encode()}
    for i, rel in enumerate(AUDIO):
        key, ext = f"audio{i}", rel.rsplit(".", 1)[1]
        media[key] = shared / rel
        samples[key] = {ext: media[key].read_bytes(), "txt": b"a transcript of the clip"}
    convs = {}
    for f in ("mllm_video_audio_demo.json", "mllm_video_demo.json"):
        for d in json.loads((shared / "mllm_demo" / f).read_text()):
            convs[Path(d["videos"][0]).name] = {"messages": d["messages"]}
    for i, name in enumerate(VIDEOS):
        key, ext = f"video{i}", name.rsplit(".", 1)[1]
        media[key] = shared / "mllm_demo" / "mllm_demo_data" / name
        samples[key] = {ext: media[key].read_bytes(), "json": json.dumps(convs[name]).encode()}
    path = root / "real-000.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path, media


def collect(endpoint: str, ranks=(0, 1), timeout: float = 120.0) -> dict[int, list]:
    """Every rank's epoch, consumed in lockstep (as training does)."""
    loaders = [EntrainLoader(endpoint, r, prefetch=2, timeout=timeout) for r in ranks]
    try:
        its = [iter(ld) for ld in loaders]
        out: dict[int, list] = {r: [] for r in ranks}
        done: set[int] = set()
        while len(done) < len(ranks):
            for r, it in zip(ranks, its):
                if r in done:
                    continue
                try:
                    out[r].append(next(it))
                except StopIteration:
                    done.add(r)
        return out
    finally:
        for ld in loaders:
            ld.close()


PRESETS = ("siglip-so400m", "internvit-300m", "qwen2.5-vl-vision", "qwen2.5-vl-vision-1280")


@pytest.mark.parametrize(
    "preset",
    [
        pytest.param(p, marks=pytest.mark.slow) if p != "qwen2.5-vl-vision-1280" else p
        for p in PRESETS
    ],
)
def test_real_media_served_per_preset(preset, tmp_path, shared_data):
    shard, media = write_real_shard(tmp_path, shared_data)
    table = build_index(str(shard), progress=False)
    index = write_index(table, tmp_path / "index.parquet")
    vision = load_module(preset)
    spec = ModelSpec(
        encoders=(vision, load_module("whisper-large-v3-encoder")),
        llm=load_module("llama-3.2-1b"),
    )
    plan = make_plan(table, spec, Cluster(2), 8, dp=2, tp=1, pp=1, microbatches=2, batches=2)
    costs = per_sample_costs(table, spec)
    row = {str(k): i for i, k in enumerate(table.keys)}
    svc = start_service(index=index, plan=plan, workers=2, socket_dir=str(tmp_path / "sock"))
    try:
        out = collect(svc.endpoint)
        assert svc.wait(30) == 0
    finally:
        svc.close()
    mbs = [mb for r in out.values() for mb in r]
    keys = sorted(str(k) for k in table.keys)
    assert sorted(k for mb in mbs for k in mb.encoder_keys) == keys
    assert sorted(k for mb in mbs for k in mb.llm_keys) == keys
    audio = AudioTransform(spec.encoders[1])
    fe = transformers.WhisperFeatureExtractor(
        feature_size=audio.n_mels, sampling_rate=16000, hop_length=audio.hop, n_fft=400
    )
    p, m, tp = vision.patch_size, vision.merge, vision.temporal_patch
    seen = {"image": 0, "video": 0, "audio": 0}
    for mb in mbs:
        t = mb.tensors
        for i, k in enumerate(mb.llm_keys):  # placeholders = the cost model's tokens
            assert int(t["llm_vision_tokens"][i]) == costs.vision_tokens[row[k]], k
            assert int(t["llm_audio_tokens"][i]) == costs.audio_tokens[row[k]], k
        if "pixel_values" in t:  # uint8 on the wire, at most 1.05x the encoder's pixels
            assert t["pixel_values"].dtype == torch.uint8
            grids = t["image_grid_thw"].numpy()
            assert t["pixel_values"].numel() <= 1.05 * int(grids.prod(axis=1).sum()) * 3 * p * p
        dev = mb.to("cpu")
        for name, gname, sname, kind in (
            ("pixel_values", "image_grid_thw", "image_sample", "image"),
            ("pixel_values_videos", "video_grid_thw", "video_sample", "video"),
        ):
            if name not in dev.tensors:
                continue
            start = 0
            for grid, owner in zip(dev[gname].tolist(), dev[sname].tolist()):
                n = int(np.prod(grid))
                rows = dev[name][start : start + n].numpy()
                start += n
                key = mb.encoder_keys[owner]
                if kind == "image":
                    ref, ref_tokens = reference_image(vision, media[key].read_bytes())
                    assert ref_tokens == n // (m * m)
                    got = rows if vision.resize == "dynamic" else unpatchify(rows, grid, p, m, tp)
                    got = got if vision.resize == "dynamic" else got[:, 0]
                else:
                    info = decode.probe_video(media[key].read_bytes())
                    ref, _ = reference_video(
                        vision, media[key], decode.sampled_frames(info.seconds)
                    )
                    got = rows
                np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=f"{preset} {key}")
                seen[kind] += 1
            assert start == len(dev[name])
        if "audio_features" in dev.tensors:
            start = 0
            for n, owner in zip(dev["audio_lengths"].tolist(), dev["audio_sample"].tolist()):
                key = mb.encoder_keys[owner]
                data = media[key].read_bytes()
                ref = fe(decode.decode_audio(data), sampling_rate=16000, return_tensors="np")
                got = dev["audio_features"][start : start + n].numpy()
                start += n
                k = min(n, 3000)
                np.testing.assert_allclose(got[:k], ref["input_features"][0][:, :k].T, atol=1e-4)
                seen["audio"] += 1
    assert seen == {"image": 12, "video": len(VIDEOS), "audio": len(AUDIO)}
    assert meta_of(vision)["pixel_mean"] == mbs[0].meta["pixel_mean"]


@pytest.mark.parametrize("preset", PRESETS)
def test_wire_bytes_per_image_within_5_percent_of_its_uint8_pixels(preset, tmp_path, shared_data):
    """One image per encoder-only microbatch, the whole wire message (header, keys, grids)."""
    from entrain_data.workers.packing import make_packer

    from entrain_data import protocol

    shard, _ = write_real_shard(tmp_path, shared_data, n_coco=3)
    table = build_index(str(shard), progress=False)
    index = write_index(table, tmp_path / "index.parquet")
    vision = load_module(preset)
    packer = make_packer(str(index), vision=vision)
    p = vision.patch_size
    rows = [i for i in range(len(table)) if table.image_offsets[i + 1] > table.image_offsets[i]]
    for r in rows:
        if int(table.image_frames[int(table.image_offsets[r])]) > 1:
            continue  # a clip: its frames are its pixels, same bound below
        packed = packer([r], [])
        head = {"epoch": 0, "iteration": 0, "microbatch": 0, "replica": 0}
        fields = {**head, "encoder_keys": packed.encoder_keys, "llm_keys": [], "meta": packed.meta}
        frames = protocol.encode("batch", fields, packed.tensors)
        wire = sum(len(f) for f in frames)
        grid = packed.tensors["image_grid_thw"]
        # the uint8 pixels the encoder sees: every patch once (SigLIP: its 378 of 384 pixels)
        pixels = int(grid.prod(axis=1).sum()) * p * p * 3
        assert wire <= 1.05 * pixels, (preset, str(table.keys[r]), wire, pixels)
