"""EntrainLoader on real decoded data: demo WebDataset shards (images, audio, text), the default packer."""

from __future__ import annotations

import pytest
import torch
from test_service import settled_stats

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput
from entrain_data.metadata import read_index, write_index
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment
from entrain_data.presets import ModelSpec

pytestmark = pytest.mark.timeout(180)


def demo_plan(dp: int = 2, microbatches: int = 2, global_batch: int = 8) -> ParallelPlan:
    model = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-1b")
    segs = (
        StageSegment("qwen2.5-vl-vision", 0, 0, model.encoders[0].layers, True, True),
        StageSegment("whisper-large-v3-encoder", 1, 0, model.encoders[1].layers, True, True),
        StageSegment("llm", None, 0, model.llm.layers, True, True),
    )
    return ParallelPlan(
        world_size=dp,
        gpus_per_node=8,
        dp=dp,
        tp=1,
        pp=1,
        stages=(StagePlan(0, segs),),
        microbatches=microbatches,
        global_batch=global_batch,
        max_tokens=1 << 20,
        defer_budget=1 << 20,
        model=model.to_dict(),
    )


@pytest.fixture(scope="module")
def demo_index(tmp_path_factory):
    from entrain_data.workers.demo_data import write_demo_dataset
    from entrain_data.workers.index_builder import build_index

    root = tmp_path_factory.mktemp("demo")
    shards = write_demo_dataset(root / "shards", samples=16, shards=2, seed=1)
    index = root / "index.parquet"
    write_index(build_index([str(p) for p in shards], progress=False), index)
    return index


def test_local_loader_serves_packed_multimodal_microbatches(tmp_path, demo_index):
    plan = demo_plan(dp=1)
    keys = set(read_index(demo_index).keys)
    with EntrainLoader.local(
        rank=0,
        index=demo_index,
        plan=plan,
        workers=2,
        timeout=90,
        socket_dir=str(tmp_path / "entrain-s"),
    ) as loader:
        assert loader.info["replica"] == 0 and loader.info["epochs"] == 1
        mbs = list(loader)
        assert [(m.iteration, m.microbatch) for m in mbs] == [
            (i, j) for i in range(2) for j in range(2)
        ]
        assert sorted(k for m in mbs for k in m.encoder_keys) == sorted(keys)
        assert sorted(k for m in mbs for k in m.llm_keys) == sorted(keys)
        for m in mbs:
            ids, cu = m["input_ids"], m["cu_seqlens"]
            assert ids.dtype == torch.int64 and int(cu[-1]) == ids.numel()
            assert len(cu) == len(m.llm_keys) + 1
            if "pixel_values" in m:
                grid = m["image_grid_thw"]
                assert m["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
        assert list(loader) == []  # the only epoch is over
        stats = settled_stats(loader, len(keys))
        assert stats["samples_served"] == len(keys) and stats["bytes_served"] > 0
        assert sum(w["tasks"] for w in stats["workers"]) >= 4
    assert not (tmp_path / "entrain-s").exists()


@pytest.mark.slow
def test_local_loader_reports_a_service_that_died(tmp_path, demo_index):
    bad = demo_plan(dp=1)
    bad = ParallelPlan.from_dict(
        {
            **bad.to_dict(),
            "model": ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b").to_dict(),
            "stages": [StagePlan(0, (StageSegment("llm", None, 0, 16, True, True),)).to_dict()],
        }
    )
    with (  # the service's own error, typed, as soon as it is gone (not a 60 s timeout)
        pytest.raises(InvalidInput, match="exited: .*audio encoder"),
        EntrainLoader.local(
            rank=0, index=demo_index, plan=bad, timeout=60, socket_dir=str(tmp_path / "entrain-s")
        ) as loader,
    ):
        list(loader)


def test_loader_arguments_are_checked():
    with pytest.raises(ValueError, match="rank"):
        EntrainLoader("ipc:///nonexistent", -1)
    with pytest.raises(ValueError, match="prefetch"):
        EntrainLoader("ipc:///nonexistent", 0, prefetch=0)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:notaport", "tcpx://host:1"])
def test_an_endpoint_zeromq_cannot_connect_to_is_named(endpoint):
    """It raised zmq's own ``ZMQError: Invalid argument``, outside the package's errors."""
    import psutil

    before = psutil.Process().num_fds()
    loader = EntrainLoader(endpoint, 3, timeout=5)
    with pytest.raises(InvalidInput, match=f"rank 3: .*endpoint '{endpoint}'"):
        next(iter(loader))
    loader.close()
    assert psutil.Process().num_fds() == before  # no context or socket left open


def _cli(*args, **kw):
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-m", "entrain_data.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


@pytest.mark.slow
def test_cli_index_then_serve_until_the_epoch_ends(tmp_path, demo_index):
    shards = sorted(str(p) for p in (demo_index.parent / "shards").glob("*.tar"))
    index = tmp_path / "index.parquet"
    p = _cli("index", *shards, "-o", str(index), "-q")
    assert p.wait(120) == 0, p.stdout.read()
    assert len(read_index(index)) == len(read_index(demo_index))
    plan = tmp_path / "plan.json"
    demo_plan(dp=2).save(plan)
    sock = tmp_path / "svc.sock"
    srv = _cli(
        "serve",
        "--index",
        str(index),
        "--plan",
        str(plan),
        "--endpoint",
        f"ipc://{sock}",
        "--workers",
        "1",
        "--stats-interval",
        "0",
    )
    try:
        loaders = [EntrainLoader(f"ipc://{sock}", r, timeout=90) for r in (0, 1)]
        got = [k for ld in loaders for m in ld for k in m.llm_keys]
        assert sorted(got) == sorted(read_index(index).keys)
        for ld in loaders:
            ld.close()
        assert srv.wait(30) == 0
        out = srv.stdout.read()
        assert "samples 16" in out and "microbatches 8" in out
    finally:
        if srv.poll() is None:
            srv.kill()
    assert not sock.exists()


def test_cli_serve_stops_on_sigint_and_reports_bad_input(tmp_path, demo_index):
    import signal

    plan = tmp_path / "plan.json"
    demo_plan(dp=2).save(plan)
    sock = tmp_path / "svc.sock"
    srv = _cli(
        "serve",
        "--index",
        str(demo_index),
        "--plan",
        str(plan),
        "--endpoint",
        f"ipc://{sock}",
        "--workers",
        "1",
    )
    try:
        ld = EntrainLoader(f"ipc://{sock}", 0, timeout=90)
        next(iter(ld))
        srv.send_signal(signal.SIGINT)
        assert srv.wait(30) == 0
        ld.close()
    finally:
        if srv.poll() is None:
            srv.kill()
    assert not sock.exists()
    bad = _cli("serve", "--index", str(tmp_path / "nope.parquet"), "--plan", str(plan))
    assert bad.wait(60) == 2
    assert "nope.parquet" in bad.stdout.read()


@pytest.mark.shared_data
def test_real_webdataset_shards_exactly_once_two_ranks(tmp_path, shared_data):
    from entrain_data.workers.index_builder import build_index

    wds = shared_data / "webdataset_testdata"
    index = tmp_path / "index.parquet"
    # 90 PNG + class samples (gzip tar) and 1,000 gzip text samples: 1,090 real samples
    write_index(
        build_index([str(wds / "sample.tgz"), str(wds / "testgz.tar")], progress=False), index
    )
    keys = list(read_index(index).keys)
    plan = demo_plan(dp=2, microbatches=2, global_batch=len(keys) // 2)
    with EntrainLoader.local(
        rank=0,
        index=index,
        plan=plan,
        workers=2,
        timeout=120,
        socket_dir=str(tmp_path / "entrain-s"),
    ) as r0:
        r1 = EntrainLoader(r0.endpoint, 1, timeout=120)
        got = {0: [], 1: []}
        for a, b in zip(r0, r1):
            got[0].append(a)
            got[1].append(b)
        r1.close()
        enc = [k for v in got.values() for m in v for k in m.encoder_keys]
        llm = [k for v in got.values() for m in v for k in m.llm_keys]
        assert sorted(enc) == sorted(keys) and sorted(llm) == sorted(keys)
        pixels = [m for v in got.values() for m in v if "pixel_values" in m]
        assert pixels  # the PNG samples were decoded and patchified


class SquaresDataset(torch.utils.data.Dataset):
    """A user's plain map-style dataset: variable-length int sequences."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"x": torch.full((4,), i, dtype=torch.int64), "n": i % 5 + 1}


def square_cost(i):
    return (0.0, float((i % 5 + 1) ** 2), i % 5 + 1)


@pytest.mark.slow
def test_wrap_runs_a_users_dataloader_inside_the_worker_pool(tmp_path):
    from test_service import make_plan

    dl = torch.utils.data.DataLoader(SquaresDataset(), batch_size=8, shuffle=True, num_workers=1)
    with EntrainLoader.wrap(
        dl, square_cost, plan=make_plan(dp=1, microbatches=2, global_batch=8), timeout=90,
        socket_dir=str(tmp_path / "entrain-s"),
    ) as loader:  # fmt: skip
        mbs = list(loader)
    assert sorted(int(k) for m in mbs for k in m.llm_keys) == list(range(24))
    for m in mbs:
        assert m["x"][:, 0].tolist() == [int(k) for k in m.llm_keys]


def test_each_encoder_stage_receives_only_the_inputs_it_reads(tmp_path, demo_index):
    """Vision, audio and LLM on three pipeline stages: the vision stage was sent the mel frames
    and the audio stage the pixels (most of the bytes), though neither reads them."""
    from dataclasses import replace

    plan = demo_plan(dp=1, microbatches=2, global_batch=4)
    segs = plan.stages[0].segments
    plan = replace(
        plan, world_size=3, pp=3, stages=tuple(StagePlan(i, (s,)) for i, s in enumerate(segs))
    )
    with EntrainLoader.local(
        rank=0, index=str(demo_index), plan=plan, workers=2, timeout=120,
        socket_dir=str(tmp_path / "s"),
    ) as r0:  # fmt: skip
        others = [EntrainLoader(r0.endpoint, r, timeout=120) for r in (1, 2)]
        try:
            stages = [list(r) for r in (r0, *others)]
        finally:
            for r in others:
                r.close()
    vision, audio, llm = stages
    assert [m.llm_keys for m in vision] == [m.llm_keys for m in audio] == [m.llm_keys for m in llm]
    assert any("pixel_values" in m for m in vision) and any("audio_features" in m for m in audio)
    assert not any("audio_features" in m for m in vision)
    assert not any(k in m for m in audio for k in ("pixel_values", "pixel_values_videos"))
    assert not any(k in m for m in llm for k in ("pixel_values", "audio_features"))
    for a, b in zip(vision, llm):  # everything else is the same microbatch
        assert a["input_ids"].equal(b["input_ids"]) and a["cu_seqlens"].equal(b["cu_seqlens"])
