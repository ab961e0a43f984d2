"""Fan-out loader benchmark: one node's service feeding 8 ranks with real-size images.

Every image is 896 x 1120 px, exactly the Qwen2.5-VL 1280-token preset's pixel budget, so each one
costs 1280 LLM tokens and 5120 patch rows of 14 x 14 x 3 uint8 (3.01 MB) on the wire. Eight
consumer processes (the ranks of a dp 8 plan) only touch what they receive: one byte per 4 KiB
page of every tensor, so each page is really read.

Sources:

- ``decode``: the service's own packer reads the JPEGs from WebDataset shards, decodes, resizes
  and patchifies them (what training runs);
- ``predecoded``: each worker decodes and packs once per microbatch size and then serves those
  real-size uint8 tensors for every microbatch of that size (with the microbatch's own keys), so
  the run measures the transport and the service around it, not JPEG decoding.

Routes compared in one run: the current tree's direct route (workers send to the ranks), the
same tree with ``direct=False`` (through the coordinator), the previous release (a git tree run in
a subprocess with ``PYTHONPATH`` pointing at it: its only route is through the coordinator), raw
pyzmq (the same message sizes from as many sender processes as the service has workers to the
8 receivers, no framing, no schedule) and torch DataLoader (each rank its own DataLoader over its
own microbatches, the same packer in its worker processes). The transport routes run in
``--fanout-rounds`` interleaved rounds and each reports its median round: with ten processes on
two cores a single run moves by a third with whatever else the machine does.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RANKS = 8
HEIGHT, WIDTH = 1120, 896  # 80 x 64 patches of 14 px: 5120 patches -> 1280 tokens after 2x2 merge
PAGE = 4096


# --------------------------------------------------------------------------------- the data
def write_images(root: str, n: int, per_shard: int = 256, distinct: int = 16) -> list[str]:
    """WebDataset shards of ``n`` JPEGs (``distinct`` different pictures) with captions."""
    import webdataset as wds
    from PIL import Image

    rng = np.random.default_rng(0)
    jpegs = []
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    for k in range(distinct):
        base = np.stack([(xx * (k + 1)) % 256, (yy * (k + 2)) % 256, (xx + yy + 17 * k) % 256], -1)
        noise = rng.integers(0, 24, size=base.shape)
        buf = io.BytesIO()
        Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        jpegs.append(buf.getvalue())
    paths = []
    for s in range(0, n, per_shard):
        path = os.path.join(root, f"images-{s // per_shard:04d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(s, min(s + per_shard, n)):
                caption = f"picture {i}: " + "a detailed description of the scene. " * (1 + i % 5)
                sink.write({"__key__": f"img{i:06d}", "jpg": jpegs[i % distinct], "txt": caption})
        paths.append(path)
    return paths


def model_spec() -> Any:
    from entrain_data.presets import ModelSpec

    return ModelSpec.from_names(["qwen2.5-vl-vision-1280"], "llama-3.2-1b")


def fanout_plan(global_batch: int, microbatches: int) -> Any:
    from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

    model = model_spec()
    segs = (
        StageSegment(model.encoders[0].name, 0, 0, model.encoders[0].layers, True, True),
        StageSegment("llm", None, 0, model.llm.layers, True, True),
    )
    return ParallelPlan(
        world_size=RANKS, gpus_per_node=8, dp=RANKS, tp=1, pp=1, stages=(StagePlan(0, segs),),
        microbatches=microbatches, global_batch=global_batch, max_tokens=1 << 22,
        defer_budget=1 << 22, model=model.to_dict(), method="sequential",
    )  # fmt: skip


# ------------------------------------------------------------------------------- the source
@dataclass(frozen=True)
class PredecodedPacker:
    """Decodes and packs once per microbatch size, then serves those tensors (real size)."""

    index: str
    model: dict

    def __call__(self) -> Any:
        from entrain_data.workers.packing import make_packer

        inner = make_packer(self.index, model=self.model)
        cache: dict[tuple[int, int], Any] = {}

        def pack(encoder_rows: list[int], llm_rows: list[int]) -> Any:
            key = (len(encoder_rows), len(llm_rows))
            if key not in cache:
                cache[key] = inner(list(range(key[0])), list(range(key[1])))
            p = cache[key]
            keys = [f"row{r}" for r in encoder_rows], [f"row{r}" for r in llm_rows]
            return type(p)(keys[0], keys[1], p.tensors, p.meta, [])

        return pack


@dataclass(frozen=True)
class IndexCosts:
    index: str
    plan_json: str

    def __call__(self) -> Any:
        from entrain_data.workers.sample_source import IndexSource

        return IndexSource(self.index, self.plan_json).costs()


def _source(kind: str, index: str, plan: Any) -> dict[str, Any]:
    """``start_service`` keyword arguments for a source."""
    if kind == "decode":
        return {"index": index}
    from entrain_data.workers.sample_source import CustomSource

    src = CustomSource(PredecodedPacker(index, plan.model), IndexCosts(index, plan.to_json()))
    return {"source": src}


# ------------------------------------------------------------------------------ consumers
def _touch(tensors: dict[str, Any]) -> int:
    """Read one byte of every page of every tensor; returns the bytes received."""
    import torch

    total = 0
    for t in tensors.values():
        flat = t.reshape(-1).view(dtype=torch.uint8)
        if flat.numel():
            int(flat[::PAGE].sum())
        total += flat.numel()
    return total


def _rank(endpoint: str, rank: int, options: dict[str, Any], start: Any, out: Any) -> None:
    from entrain_data.client import EntrainLoader

    loader = EntrainLoader(endpoint, rank, prefetch=4, timeout=600, **options)
    it = iter(loader)
    first = next(it)  # start-up (spawn, imports, first assignment) is not counted,
    start.wait(600)  # nor the other ranks' (their imports would share the cores with it)
    t0 = time.perf_counter()
    images = nbytes = pixels = 0
    for mb in it:
        nbytes += _touch(mb.tensors)
        images += len(mb.encoder_keys)
        if "pixel_values" in mb:
            pixels += mb["pixel_values"].numel()
    out.put((rank, t0, time.perf_counter(), images, nbytes, pixels, len(first.encoder_keys)))
    loader.close()


def run_service(index: str, plan: Any, workers: int, source: str, direct: bool | None) -> dict:
    """8 ranks of one service; ``direct`` None: the tree's only route (a previous release)."""
    from entrain_data.workers.service import start_service

    options = {} if direct is None else {"direct": direct}
    with tempfile.TemporaryDirectory(prefix="entrain-fanout-") as d:
        svc = start_service(
            plan=plan,
            workers=workers,
            socket_dir=os.path.join(d, "s"),
            **_source(source, index, plan),
        )
        try:
            return _rates(_per_rank(_rank, lambda r: (svc.endpoint, r, options)))
        finally:
            svc.close()


def _rates(res: list[tuple]) -> dict:
    t0, t1 = min(r[1] for r in res), max(r[2] for r in res)
    images, nbytes, pixels = (sum(r[i] for r in res) for i in (3, 4, 5))
    return {
        "seconds": t1 - t0,
        "images": images,
        "samples_per_s": images / (t1 - t0),
        "mb_per_s": nbytes / 1e6 / (t1 - t0),
        "wire_bytes_per_image": nbytes / max(images, 1),
        "pixel_bytes_per_image": pixels / max(images, 1),
    }


# ---------------------------------------------------------------------------- raw pyzmq
def _raw_receiver(endpoint: str, count: int, out: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    sock.recv_multipart()
    t0, nbytes = time.perf_counter(), 0
    for _ in range(count - 1):
        for f in sock.recv_multipart(copy=False):
            view = np.frombuffer(f.buffer, np.uint8)
            if view.size:
                int(view[::PAGE].sum())
            nbytes += view.size
    out.put((0, t0, time.perf_counter(), 0, nbytes, 0, 0))
    sock.close(0)
    ctx.term()


def _raw_sender(endpoints: list[str], sizes: list[int], start: int, step: int) -> None:
    import zmq

    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PUSH) for _ in endpoints]
    for s, ep in zip(socks, endpoints):
        s.connect(ep)
    bufs = {n: np.full(n, 7, np.uint8) for n in set(sizes)}
    for i in range(start, len(sizes) * len(endpoints), step):
        socks[i % len(endpoints)].send(bufs[sizes[(i // len(endpoints)) % len(sizes)]], copy=False)
    for s in socks:
        s.close(linger=-1)
    ctx.term()


def run_raw(sizes: list[int], senders: int) -> dict:
    """The same message sizes, ``senders`` processes round-robin to 8 receivers over ipc."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="entrain-fanout-raw-") as d:
        eps = [f"ipc://{d}/r{r}.sock" for r in range(RANKS)]
        recv = [ctx.Process(target=_raw_receiver, args=(e, len(sizes), out)) for e in eps]
        for p in recv:
            p.start()
        time.sleep(1.0)
        send = [
            ctx.Process(target=_raw_sender, args=(eps, sizes, k, senders)) for k in range(senders)
        ]
        for p in send:
            p.start()
        res = [out.get(timeout=600) for _ in recv]
        for p in recv + send:
            p.join(60)
    r = _rates(res)
    return {"seconds": r["seconds"], "mb_per_s": r["mb_per_s"]}


# ------------------------------------------------------------------------ torch DataLoader
class _RankMicrobatches:
    """Rank r's microbatches of the service's schedule, packed by the same packer."""

    def __init__(self, index: str, plan_json: str, rank: int, source: str) -> None:
        from entrain_data.workers.sample_source import IndexSource
        from entrain_data.workers.schedule import Scheduler

        from entrain_data.plan import ParallelPlan

        plan = ParallelPlan.from_json(plan_json)
        src = IndexSource(index, plan_json)
        sch = Scheduler.for_plan(plan, src.costs(), seed=0, source=src)  # the service's schedule
        self.slots = [
            sch.slots(0, it)[rank][mb]
            for it in range(sch.shape.iterations)
            for mb in range(sch.shape.microbatches)
        ]
        self.index, self.model, self.source = index, plan.model, source
        self.packer: Any = None

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.packer is None:  # built inside the DataLoader worker
            if self.source == "decode":
                from entrain_data.workers.packing import make_packer

                self.packer = make_packer(self.index, model=self.model)
            else:
                self.packer = PredecodedPacker(self.index, self.model)()
        s = self.slots[i]
        packed = self.packer(s.encoder_rows.tolist(), s.llm_rows.tolist())
        out = {k: torch.from_numpy(np.array(v)) for k, v in packed.tensors.items()}
        out["images"] = torch.tensor(len(packed.encoder_keys))
        return out


def _dl_rank(
    index: str, plan_json: str, rank: int, source: str, workers: int, start: Any, out: Any
) -> None:
    import torch

    ds = _RankMicrobatches(index, plan_json, rank, source)
    dl = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, prefetch_factor=4, multiprocessing_context="spawn"
    )
    it = iter(dl)
    next(it)
    start.wait(600)
    t0 = time.perf_counter()
    images = nbytes = pixels = 0
    for batch in it:
        images += int(batch.pop("images"))
        nbytes += _touch(batch)
        pixels += batch["pixel_values"].numel() if "pixel_values" in batch else 0
    out.put((rank, t0, time.perf_counter(), images, nbytes, pixels, 0))


def run_dataloader(index: str, plan: Any, workers: int, source: str) -> dict:
    return _rates(_per_rank(_dl_rank, lambda r: (index, plan.to_json(), r, source, workers)))


def _per_rank(target: Any, args_of: Any) -> list:
    """One spawned process per rank running ``target(*args_of(rank), start, queue)``; their
    reports. Each starts its clock once all have their first microbatch (``start``)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(RANKS)
    procs = [ctx.Process(target=target, args=(*args_of(r), start, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    res = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    return res


# ------------------------------------------------------------------- the previous release
def _package_of(tree: str, root: str) -> str:
    """``tree``'s package laid out as installed, under ``root``: ``entrain_data`` with its
    ``workers`` and ``adapters`` inside (in the tree they sit beside it and the editable
    install of this tree would otherwise supply them)."""
    pkg = os.path.join(root, "entrain_data")
    shutil.copytree(os.path.join(tree, "entrain_data"), pkg)
    for sub in ("workers", "adapters"):
        if os.path.isdir(os.path.join(tree, sub)) and not os.path.exists(os.path.join(pkg, sub)):
            os.symlink(os.path.join(os.path.abspath(tree), sub), os.path.join(pkg, sub))
    return root


def run_previous(tree: str, index: str, plan: Any, workers: int, source: str) -> dict:
    """This module's service run with ``entrain_data`` (workers included) from ``tree``."""
    with tempfile.TemporaryDirectory(prefix="entrain-fanout-prev-") as d:
        path = _package_of(tree, os.path.join(d, "pkg"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(HERE)])}
        plan_path = os.path.join(d, "plan.json")
        Path(plan_path).write_text(plan.to_json())
        code = (
            "import json, sys, entrain_data, _fanout\n"
            "import entrain_data.workers.service as service\n"
            "from entrain_data.plan import ParallelPlan\n"
            f"for m in (entrain_data, service):\n"
            f"    assert m.__file__.startswith({path!r}), m.__file__\n"
            f"plan = ParallelPlan.load({plan_path!r})\n"
            f"r = _fanout.run_service({index!r}, plan, {workers}, {source!r}, None)\n"
            f"r['imported_from'] = {tree!r}\n"
            "print('RESULT ' + json.dumps(r))\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=d, env=env, capture_output=True, text=True
        )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"previous release run failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT ") :])


# ---------------------------------------------------------------------------------- report
def _median_run(runs: list[dict], key: str) -> dict:
    """The run with the median ``key`` (it stands for the route: its images/s, bytes per
    image), with every run's ``key`` beside it as ``{key}_runs``."""
    median = sorted(runs, key=lambda x: x[key])[(len(runs) - 1) // 2]
    return {**median, f"{key}_runs": [x[key] for x in runs]}


def main(args: Any) -> dict:
    """Every route and baseline on the same data; prints the table and the issue's ratios."""
    from entrain_data.workers.index_builder import build_index

    from entrain_data.metadata import write_index

    tmp = tempfile.TemporaryDirectory(prefix="entrain-fanout-data-")
    n = max(args.fanout_images, args.decode_images)
    shards = write_images(tmp.name, n)
    index = os.path.join(tmp.name, "index.parquet")
    write_index(build_index(shards, progress=False), index)
    sub = os.path.join(tmp.name, "decode.parquet")  # the first decode_images samples
    write_index(build_index(shards, progress=False).take(np.arange(args.decode_images)), sub)
    plan = fanout_plan(args.global_batch, args.microbatches)
    w = args.workers
    rows: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}

    def row(name: str, fn: Any, *a: Any) -> None:
        t = time.perf_counter()
        r = fn(*a)
        runs.setdefault(name, []).append(r)
        rows[name] = _median_run(runs[name], "mb_per_s")
        print(f"  {name}: {r['mb_per_s']:.0f} MB/s ({time.perf_counter() - t:.0f} s)")

    print(f"fan-out {RANKS}: {n} images of {WIDTH}x{HEIGHT} px, {w} workers")
    per_rank_mbs = args.fanout_images // RANKS // (args.global_batch // RANKS // args.microbatches)
    # the transport routes take turns, round after round: on a 2-core machine one run swings
    # by a third with what else the machine does, the median of interleaved rounds does not
    for k in range(args.fanout_rounds):
        print(f" round {k + 1} of {args.fanout_rounds}")
        row("direct (this tree)", run_service, index, plan, w, "predecoded", True)
        row("through the coordinator (this tree, direct=False)", run_service, index, plan, w,
            "predecoded", False)  # fmt: skip
        if args.previous:
            row("previous release (coordinator hop)", run_previous, args.previous, index, plan,
                w, "predecoded")  # fmt: skip
        mb_bytes = int(rows["direct (this tree)"]["wire_bytes_per_image"] * args.global_batch
                       / RANKS / args.microbatches)  # fmt: skip
        row("raw pyzmq (same message sizes)", run_raw, [mb_bytes] * per_rank_mbs, w)
    row("torch DataLoader (1 worker per rank)", run_dataloader, index, plan, 1, "predecoded")
    decode: dict[int, dict] = {}
    decode_runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.fanout_rounds):  # interleaved too, each worker count its median round
        for k in (1, 2):
            r = run_service(sub, fanout_plan(args.global_batch, args.microbatches), k, "decode",
                            True)  # fmt: skip
            decode_runs[k].append(r)
            print(f"  decode, {k} worker(s): {r['samples_per_s']:.1f} images/s")
    for k, got in decode_runs.items():
        decode[k] = _median_run(got, "samples_per_s")
    direct = rows["direct (this tree)"]
    ratios = {
        "direct / raw pyzmq (>= 0.90)": direct["mb_per_s"]
        / rows["raw pyzmq (same message sizes)"]["mb_per_s"],
        "direct / this tree's hop": direct["mb_per_s"]
        / rows["through the coordinator (this tree, direct=False)"]["mb_per_s"],
        "direct / torch DataLoader": direct["mb_per_s"]
        / rows["torch DataLoader (1 worker per rank)"]["mb_per_s"],
        "wire bytes / uint8 pixels per image (<= 1.05)": direct["wire_bytes_per_image"]
        / (HEIGHT * WIDTH * 3),
        "2 workers / 1 worker, real decode (>= 1.5)": decode[2]["samples_per_s"]
        / decode[1]["samples_per_s"],
    }
    previous = rows.get("previous release (coordinator hop)")  # with --previous only
    if previous:
        ratios["direct / previous release hop (>= 2.0)"] = direct["mb_per_s"] / previous["mb_per_s"]
    print(f"\n{'route (median of the rounds)':<52} {'images/s':>9} {'MB/s':>8}  each round")
    for name, r in rows.items():
        ips = r.get("samples_per_s")
        each = " / ".join(f"{x:.0f}" for x in r.get("mb_per_s_runs", []))
        print(f"{name:<52} {'' if ips is None else f'{ips:9.1f}':>9} {r['mb_per_s']:>8.0f}  {each}")
    for k, r in decode.items():
        each = " / ".join(f"{x:.1f}" for x in r["samples_per_s_runs"])
        name = f"real decode, {k} worker(s) (images/s each round)"
        print(f"{name:<52} {r['samples_per_s']:>9.1f} {r['mb_per_s']:>8.0f}  {each}")
    print()
    for name, v in ratios.items():
        print(f"{name:<52} {v:.3f}")
    tmp.cleanup()
    return {
        "images": n,
        "image_px": [WIDTH, HEIGHT],
        "workers": w,
        "global_batch": args.global_batch,
        "rounds": args.fanout_rounds,
        "microbatches": args.microbatches,
        "routes": rows,
        "decode": {str(k): v for k, v in decode.items()},
        "ratios": ratios,
        "load_average": os.getloadavg(),
    }
