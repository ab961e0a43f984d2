"""Loader throughput: EntrainLoader versus torch DataLoader (same workers, same decode and
transform), and the wire transport versus a raw pyzmq send of the same buffers, in one run.

``--fanout``: one node's service feeding 8 ranks with real-size images (1280 LLM tokens each),
against raw pyzmq, the coordinator route, the previous release and torch DataLoader (see
``_fanout.py``)::

    python bench/loader_throughput.py --fanout --previous /path/to/previous/release/tree

Both loaders build the very same microbatches (the service's schedule and assignment, the
default packer: read tar members, decode JPEG/PNG/WAV, resize, patchify, log-mel, tokenise,
pack); the DataLoader runs the packer in its own worker processes, one microbatch per item.
So the ratio measures what the service adds or saves around identical work.

Transport: one sender process, one receiver, ipc, the captured microbatch tensors:
``protocol`` (msgpack header + zero-copy buffers, decode with every check + torch.frombuffer)
versus raw pyzmq multipart of the same buffers (copy=False, no header, no checks).

    python bench/loader_throughput.py [--samples 256] [--workers 2] [--shards DIR_OR_GLOB]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from entrain_data import protocol
from entrain_data.client import EntrainLoader
from entrain_data.connection import tensors_of as _tensors
from entrain_data.metadata import read_index, write_index
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment
from entrain_data.presets import ModelSpec

RESULTS = Path(__file__).resolve().parent / "results"


def make_plan(microbatches: int, global_batch: int) -> ParallelPlan:
    model = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-1b")
    segs = (
        StageSegment("qwen2.5-vl-vision", 0, 0, model.encoders[0].layers, True, True),
        StageSegment("whisper-large-v3-encoder", 1, 0, model.encoders[1].layers, True, True),
        StageSegment("llm", None, 0, model.llm.layers, True, True),
    )
    return ParallelPlan(
        world_size=1, gpus_per_node=8, dp=1, tp=1, pp=1, stages=(StagePlan(0, segs),),
        microbatches=microbatches, global_batch=global_batch, max_tokens=1 << 22,
        defer_budget=1 << 22, model=model.to_dict(),
    )  # fmt: skip


class MicrobatchDataset(torch.utils.data.Dataset):
    """Item i = the i-th microbatch of the service's schedule, packed by the same packer."""

    def __init__(self, index: str, plan_json: str, seed: int) -> None:
        from entrain_data.workers.sample_source import IndexSource
        from entrain_data.workers.schedule import Scheduler

        enc, llm, tok = IndexSource(index, plan_json).costs()
        plan = ParallelPlan.from_json(plan_json)
        sch = Scheduler(
            enc, llm, tok, dp=1, microbatches=plan.microbatches, global_batch=plan.global_batch,
            max_tokens=plan.max_tokens, defer_budget=plan.defer_budget, method=plan.method,
            seed=seed,
        )  # fmt: skip
        m = sch.shape.microbatches
        self.slots = [sch.slots(0, p // m)[0][p % m] for p in range(sch.shape.per_epoch)]
        self.index, self.model = index, plan.model
        self.packer = None

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.packer is None:  # built lazily inside each DataLoader worker
            from entrain_data.workers.packing import make_packer

            self.packer = make_packer(self.index, model=self.model)
        s = self.slots[i]
        packed = self.packer(s.encoder_rows.tolist(), s.llm_rows.tolist())
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.tensors.items()}


def _nbytes(tensors) -> int:
    return sum(int(t.numel() * t.element_size()) for t in tensors.values())


def run_entrain(index: str, plan: ParallelPlan, workers: int, seed: int) -> dict:
    from entrain_data.workers.service import start_service

    with tempfile.TemporaryDirectory(prefix="entrain-bench-") as d:
        svc = start_service(index=index, plan=plan, workers=workers, seed=seed,
                            socket_dir=str(Path(d) / "entrain-s"))  # fmt: skip
        try:
            loader = EntrainLoader(svc.endpoint, 0, prefetch=8, timeout=300)
            it = iter(loader)
            first = next(it)  # service and worker start-up excluded, as for the DataLoader
            t0 = time.perf_counter()
            samples, nbytes, mbs = len(first.llm_keys), _nbytes(first.tensors), 1
            for mb in it:
                samples += len(mb.llm_keys)
                nbytes += _nbytes(mb.tensors)
                mbs += 1
            dt = (time.perf_counter() - t0) * mbs / max(mbs - 1, 1)
            loader.close()
        finally:
            svc.close()
    return {"samples": samples, "microbatches": mbs, "bytes": nbytes, "seconds": dt}


def run_dataloader(index: str, plan: ParallelPlan, workers: int, seed: int) -> dict:
    ds = MicrobatchDataset(index, plan.to_json(), seed)
    dl = torch.utils.data.DataLoader(
        ds, batch_size=None, shuffle=False, num_workers=workers,
        multiprocessing_context="spawn", prefetch_factor=4, persistent_workers=False,
    )  # fmt: skip
    it = iter(dl)
    first = next(it)  # worker start-up excluded, as for the service
    t0 = time.perf_counter()
    samples = int(first["cu_seqlens"].numel() - 1)
    nbytes, mbs = _nbytes(first), 1
    for batch in it:
        samples += int(batch["cu_seqlens"].numel() - 1)
        nbytes += _nbytes(batch)
        mbs += 1
    dt = time.perf_counter() - t0
    # one microbatch was taken before the clock: scale to the same count
    return {"samples": samples, "microbatches": mbs, "bytes": nbytes,
            "seconds": dt * mbs / max(mbs - 1, 1)}  # fmt: skip


def _sender(endpoint: str, arrays: list[dict[str, np.ndarray]], rounds: int, raw: bool) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 16)
    s.connect(endpoint)
    for r in range(rounds):
        for i, t in enumerate(arrays):
            if raw:
                s.send_multipart([memoryview(v) for v in t.values()], copy=False)
            else:
                s.send_multipart(protocol.encode("batch", {"iteration": r, "microbatch": i}, t),
                                 copy=False)  # fmt: skip
    s.send(b"")
    s.close(linger=-1)
    ctx.term()


def run_transport(arrays: list[dict[str, np.ndarray]], rounds: int, raw: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="entrain-bench-") as d:
        ep = f"ipc://{d}/t.sock"
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 16)
        pull.bind(ep)
        p = mp.get_context("spawn").Process(target=_sender, args=(ep, arrays, rounds, raw))
        p.start()
        nbytes = n = 0
        t0 = None
        while True:
            if not pull.poll(120_000):
                raise TimeoutError("transport sender stalled")
            frames = pull.recv_multipart(copy=False)
            if t0 is None:
                t0 = time.perf_counter()
            if len(frames) == 1 and len(frames[0]) == 0:
                break
            if raw:
                nbytes += sum(len(f) for f in frames)
            else:
                tensors = _tensors(protocol.decode(frames))
                nbytes += _nbytes(tensors)
            n += 1
        dt = time.perf_counter() - t0
        p.join(30)
        pull.close(0)
        ctx.term()
    return {"messages": n, "bytes": nbytes, "seconds": dt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256, help="demo samples (ignored with --shards)")
    ap.add_argument("--shards", nargs="*", help="existing WebDataset shards (default: demo data)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--transport-rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON (default: results/loader_*.json)")
    ap.add_argument("--fanout", action="store_true", help="8 ranks, real-size images (see above)")
    ap.add_argument("--fanout-images", type=int, default=2048, help="images, transport runs")
    ap.add_argument("--decode-images", type=int, default=768, help="images, real-decode runs")
    ap.add_argument("--fanout-batch", type=int, default=128, help="global batch (fan-out)")
    ap.add_argument(
        "--fanout-rounds", type=int, default=3, help="interleaved rounds of the transport routes"
    )
    ap.add_argument("--previous", help="a git tree of the previous release, run for comparison")
    args = ap.parse_args(argv)
    if args.fanout:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _fanout

        args.global_batch = args.fanout_batch
        result = _fanout.main(args)
        result["command"] = " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])
        out = Path(args.out or RESULTS / "loader_fanout.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        return 0
    args.out = args.out or str(RESULTS / "loader_throughput.json")

    from entrain_data.workers.demo_data import write_demo_dataset
    from entrain_data.workers.index_builder import build_index

    tmp = tempfile.TemporaryDirectory(prefix="entrain-bench-data-")
    shards = args.shards or [str(p) for p in write_demo_dataset(tmp.name, args.samples, 4, 0)]
    index = str(Path(tmp.name) / "index.parquet")
    write_index(build_index(shards, progress=False), index)
    n = len(read_index(index))
    plan = make_plan(args.microbatches, min(args.global_batch, n))

    ent = run_entrain(index, plan, args.workers, args.seed)
    tdl = run_dataloader(index, plan, args.workers, args.seed)

    # the transport on the very microbatches the loader produced
    ds = MicrobatchDataset(index, plan.to_json(), args.seed)
    arrays = [{k: v.numpy() for k, v in ds[i].items()} for i in range(min(len(ds), 16))]
    raw = run_transport(arrays, args.transport_rounds, raw=True)
    ours = run_transport(arrays, args.transport_rounds, raw=False)

    def rate(r):
        return r["samples"] / r["seconds"], r["bytes"] / 1e6 / r["seconds"]

    rows = []
    for name, r in (("EntrainLoader", ent), ("torch DataLoader", tdl)):
        sps, mbps = rate(r)
        rows.append({"loader": name, "samples_per_s": sps, "mb_per_s": mbps, **r})
    t_raw = raw["bytes"] / 1e6 / raw["seconds"]
    t_ours = ours["bytes"] / 1e6 / ours["seconds"]
    result = {
        "samples": n,
        "workers": args.workers,
        "microbatches": args.microbatches,
        "global_batch": plan.global_batch,
        "shards": shards if args.shards else "demo",
        "loaders": rows,
        "ratio_vs_dataloader": rows[0]["samples_per_s"] / rows[1]["samples_per_s"],
        "transport": {
            "protocol_mb_per_s": t_ours,
            "raw_pyzmq_mb_per_s": t_raw,
            "ratio": t_ours / t_raw,
            "message_mb": raw["bytes"] / 1e6 / raw["messages"],
        },
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
    }
    print(f"{'loader':<18} {'samples/s':>10} {'MB/s':>9} {'seconds':>8}")
    for r in rows:
        print(
            f"{r['loader']:<18} {r['samples_per_s']:>10.1f} {r['mb_per_s']:>9.1f} {r['seconds']:>8.2f}"
        )
    print(f"EntrainLoader / DataLoader: {result['ratio_vs_dataloader']:.2f}x")
    print(f"transport: protocol {t_ours:.0f} MB/s, raw pyzmq {t_raw:.0f} MB/s "
          f"-> {100 * result['transport']['ratio']:.0f}% "
          f"({result['transport']['message_mb']:.2f} MB/message)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
