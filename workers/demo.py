"""``entrain-data demo``: the whole system end to end on bundled, generated data, on CPU.

1. writes a small multimodal WebDataset (real JPEG/PNG images from thumbnails to
   document pages, WAV clips of 1-30 s, texts of varied length) with the
   project's own generator, cached under ``--out``;
2. builds the Parquet index from the shard headers;
3. macro-profiles it and derives the static plan for 2 data-parallel ranks;
4. for ``sequential`` (Megatron-LM's fixed-count microbatches) and then
   ``entrain``, starts the loader service, trains the tiny reference MLLM
   (vision + audio encoders, decoder LLM) with DDP on 2 gloo ranks through the
   torch adapter, and times every microbatch's encoder and LLM forward; between
   the two runs the cost model is calibrated (least squares) to the timings of
   the first, and the plan that ``entrain`` is served from carries that fit;
5. prints the balance table (per-microbatch load CV measured in this run, the
   cost model's CV, measured and simulated step time) and plots the loads.

Everything it starts (service, workers, ranks) is stopped before it returns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from entrain_data.cost_model import calibrate, per_sample_costs
from entrain_data.errors import EntrainError, WorkerDied
from entrain_data.metadata import read_index, write_index
from entrain_data.plan import Cluster, ParallelPlan
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec, ModuleConfig
from entrain_data.profiler import macro_profile
from entrain_data.simulator import simulate_pipeline

__all__ = ["register", "run_demo", "demo_model_spec", "demo_reference_config", "METHODS"]

log = logging.getLogger(__name__)

METHODS = ("sequential", "entrain")
RANKS = 2


def demo_model_spec() -> ModelSpec:
    """Cost-model view of the demo's tiny MLLM; token geometry matches the reference model
    (one encoder token per 16 px patch and per audio frame at 10 frames/s)."""
    vision = ModuleConfig(
        name="demo-vision",
        kind="vision",
        hidden=96,
        layers=2,
        ffn=192,
        heads=2,
        kv_heads=2,
        patch_size=16,
        temporal_patch=1,
        merge=1,
        resize="dynamic",
        min_pixels=32 * 32,
        max_pixels=192 * 192,
        source="entrain_data demo",
    )
    audio = ModuleConfig(
        name="demo-audio",
        kind="audio",
        hidden=32,
        layers=2,
        ffn=64,
        heads=2,
        kv_heads=2,
        n_mels=16,
        audio_frame_rate=10.0,
        audio_conv_stride=1,
        audio_window_seconds=30.0,
        audio_pool=1,
        source="entrain_data demo",
    )
    llm = ModuleConfig(
        name="demo-llm",
        kind="llm",
        hidden=64,
        layers=2,
        ffn=128,
        heads=4,
        kv_heads=4,
        vocab=261,
        source="entrain_data demo",
    )
    return ModelSpec(encoders=(vision, audio), llm=llm, name="demo")


def demo_reference_config():
    """The reference model with the demo spec's sizes."""
    from entrain_data.adapters.reference_model import ReferenceConfig

    spec = demo_model_spec()
    v, a = spec.encoders
    return ReferenceConfig(
        vocab=spec.llm.vocab,
        hidden=spec.llm.hidden,
        heads=2,
        llm_layers=spec.llm.layers,
        patch_dim=3 * v.temporal_patch * v.patch_size**2,
        vision_hidden=v.hidden,
        n_mels=a.n_mels,
        audio_hidden=a.hidden,
    )


# ---------------------------------------------------------------- the ranks
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, endpoint: str, out_path: str, seed: int, lr: float) -> None:
    """One training rank: DDP over gloo, microbatches from the loader service, timed forwards."""
    import torch
    import torch.distributed as dist
    from entrain_data.adapters.common import group_iterations
    from entrain_data.adapters.reference_model import ReferenceMLLM
    from entrain_data.adapters.torch import accumulate_gradients

    from entrain_data.client import EntrainLoader

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        torch.manual_seed(seed)
        model = ReferenceMLLM(demo_reference_config())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
        enc_time = {"vision": 0.0, "audio": 0.0}
        starts: dict[str, float] = {}

        def hooks(name: str):
            def pre(_mod, _inp):
                starts[name] = time.thread_time()

            def post(_mod, _inp, _out):
                enc_time[name] += time.thread_time() - starts.pop(name)

            return pre, post

        for name, enc in (("vision", model.vision), ("audio", model.audio)):
            pre, post = hooks(name)
            enc.register_forward_pre_hook(pre)
            enc.register_forward_hook(post)
        records: list[dict[str, Any]] = []
        steps: list[dict[str, Any]] = []

        def forward(m, mb, buffer):
            enc_time["vision"] = enc_time["audio"] = 0.0
            t0, w0 = time.thread_time(), time.perf_counter()
            out = m(mb, buffer)
            total, wall = time.thread_time() - t0, time.perf_counter() - w0
            enc = enc_time["vision"] + enc_time["audio"]
            records.append(
                {
                    "iteration": mb.iteration,
                    "epoch": mb.epoch,
                    "microbatch": mb.microbatch,
                    "replica": mb.replica,
                    "encoder_keys": list(mb.encoder_keys),
                    "llm_keys": list(mb.llm_keys),
                    "encoder_fwd": enc,
                    "vision_fwd": enc_time["vision"],
                    "audio_fwd": enc_time["audio"],
                    "llm_fwd": total - enc,
                    "wall_fwd": wall,
                    "tokens": mb.num_tokens,
                }
            )
            return out

        with EntrainLoader(endpoint, rank, timeout=120.0) as loader:
            for mbs in group_iterations(loader):
                t0 = time.perf_counter()
                res = accumulate_gradients(ddp, mbs, forward)
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps.append(
                    {
                        "epoch": mbs[0].epoch,
                        "iteration": mbs[0].iteration,
                        "seconds": time.perf_counter() - t0,
                        "loss": res.loss,
                    }
                )
        Path(out_path).write_text(
            json.dumps({"rank": rank, "microbatches": records, "steps": steps})
        )
    finally:
        dist.destroy_process_group()


# glibc malloc: keep freed memory in the heap instead of returning it to the OS. Every
# iteration frees and reallocates the same activations; with the defaults each large
# block comes back through fresh page faults, CPU time that lands in whichever forward
# allocates first and swamps the tiny demo encoders' timings (the CPU analogue of
# running PyTorch with jemalloc/tcmalloc). Settings the user made are kept.
_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(512 << 20),
}


@contextlib.contextmanager
def _rank_allocator_env():
    """Spawned rank processes start with :data:`_MALLOC_ENV`; this process's env is restored."""
    added = {k: v for k, v in _MALLOC_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _train(method: str, plan: ParallelPlan, index: Path, out: Path, args) -> list[dict]:
    """Serve ``plan`` with ``method`` and train on 2 ranks; returns each rank's records."""
    import torch.multiprocessing as mp
    from entrain_data.workers.service import start_service

    plan_path = plan.with_method(method).save(out / f"plan-{method}.json")
    results = [out / f"run-{method}-rank{r}.json" for r in range(RANKS)]
    for p in results:
        p.unlink(missing_ok=True)
    service = start_service(
        index=index, plan=plan_path, workers=args.workers, seed=args.seed, epochs=args.epochs
    )
    procs = []
    try:
        port = _free_port()
        ctx = mp.get_context("spawn")
        with _rank_allocator_env():
            for r in range(RANKS):
                p = ctx.Process(
                    target=_rank_main,
                    name=f"entrain-demo-rank{r}",
                    args=(r, port, service.endpoint, str(results[r]), args.seed, args.lr),
                )
                p.start()
                procs.append(p)
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        bad = [p for p in procs if p.exitcode != 0]
        if bad:
            raise WorkerDied(
                f"demo ({method}): rank process(es) {[p.name for p in bad]} failed or timed out "
                f"(exit codes {[p.exitcode for p in bad]}); see the log above"
            )
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        service.close()
    return [json.loads(p.read_text()) for p in results]


# ------------------------------------------------------------------ figures
def _measured(runs: list[dict]) -> list[dict]:
    """Every rank's timed microbatches after its first (warm-up) iteration.

    The first forward of a process pays one-off costs (allocator growth, lazy
    kernel set-up) that say nothing about the microbatch; like any benchmark,
    the demo leaves that iteration out of its figures, for both methods alike.
    """
    out = []
    for r in runs:
        mbs = r["microbatches"]
        if not mbs:
            continue
        first = min((m["epoch"], m["iteration"]) for m in mbs)
        out.extend(m for m in mbs if (m["epoch"], m["iteration"]) != first)
    return out


def _calibrate(table, spec: ModelSpec, runs: list[dict], key_row: dict[str, int]):
    """Least-squares fit of every module's forward time to this run's per-microbatch timings."""
    mbs = _measured(runs)
    cal = None
    fits = {}
    for module, field, keys in (
        (spec.encoders[0].name, "vision_fwd", "encoder_keys"),
        (spec.encoders[1].name, "audio_fwd", "encoder_keys"),
        ("llm", "llm_fwd", "llm_keys"),
    ):
        used = [m for m in mbs if m[keys] and m[field] > 0]
        if len(used) < 4:
            continue
        groups = [np.array([key_row[k] for k in m[keys]]) for m in used]
        cal = calibrate(table, spec, module, groups, [m[field] for m in used], previous=cal)
        fits[module] = cal.get(module)
    if cal is None:
        raise EntrainError("demo: the sequential run recorded too few microbatches to calibrate")
    return cal, fits


def _cv(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.std() / x.mean()) if len(x) and x.mean() > 0 else 0.0


def _summarise(method: str, runs: list[dict], costs, key_row: dict[str, int]) -> dict[str, Any]:
    """Per-microbatch load CVs (measured and cost model) and step times of one method."""
    mbs = _measured(runs)
    enc_model = costs.encoder_cost().sum(axis=1)
    llm_model = costs.llm_cost()

    def modelled(keys, arr):
        return float(arr[[key_row[k] for k in keys]].sum()) if keys else 0.0

    enc_m = np.array([modelled(m["encoder_keys"], enc_model) for m in mbs])
    llm_m = np.array([modelled(m["llm_keys"], llm_model) for m in mbs])
    # measured step: the slower rank of each iteration (DP ranks wait for each other)
    by_step: dict[tuple, float] = {}
    for r in runs:
        for s in r["steps"]:
            k = (s["epoch"], s["iteration"])
            by_step[k] = max(by_step.get(k, 0.0), s["seconds"])
    # simulated step: the cost model's per-microbatch times through the pipeline simulator
    sims = []
    groups: dict[tuple, list[dict]] = {}
    for m in mbs:
        groups.setdefault((m["epoch"], m["iteration"]), []).append(m)
    for items in groups.values():
        reps = sorted({m["replica"] for m in items})
        n_mb = max(m["microbatch"] for m in items) + 1
        fwd = np.zeros((len(reps), n_mb, 1))
        for m in items:
            fwd[reps.index(m["replica"]), m["microbatch"], 0] = modelled(
                m["encoder_keys"], enc_model
            ) + modelled(m["llm_keys"], llm_model)
        sims.append(simulate_pipeline(fwd / 3.0, fwd * 2.0 / 3.0).iteration_time)  # bwd = 2 fwd
    steps = np.array(sorted(by_step.values()))
    return {
        "method": method,
        "microbatches": len(mbs),
        "encoder_cv_measured": _cv([m["encoder_fwd"] for m in mbs]),
        "llm_cv_measured": _cv([m["llm_fwd"] for m in mbs]),
        "encoder_cv_model": _cv(enc_m),
        "llm_cv_model": _cv(llm_m),
        "step_seconds_measured": float(np.median(steps[1:] if len(steps) > 2 else steps)),
        "step_seconds_simulated": float(np.mean(sims)),
        "steps": len(steps),
        "final_loss": float(np.mean([r["steps"][-1]["loss"] for r in runs if r["steps"]])),
        "series": {
            "encoder_fwd": [m["encoder_fwd"] for m in sorted(mbs, key=_order)],
            "llm_fwd": [m["llm_fwd"] for m in sorted(mbs, key=_order)],
        },
    }


def _order(m: dict) -> tuple:
    return (m["epoch"], m["iteration"], m["replica"], m["microbatch"])


def _table(rows: list[dict]) -> str:
    head = (
        f"{'method':<11} {'enc CV meas':>11} {'LLM CV meas':>11} {'enc CV model':>12} "
        f"{'LLM CV model':>12} {'step meas s':>11} {'step sim s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['method']:<11} {r['encoder_cv_measured']:>11.3f} {r['llm_cv_measured']:>11.3f} "
            f"{r['encoder_cv_model']:>12.3f} {r['llm_cv_model']:>12.3f} "
            f"{r['step_seconds_measured']:>11.3f} {r['step_seconds_simulated']:>10.3f}"
        )
    seq, ent = rows
    lines.append(
        f"entrain vs sequential: encoder CV {seq['encoder_cv_measured'] / max(ent['encoder_cv_measured'], 1e-12):.2f}x lower, "
        f"LLM CV {seq['llm_cv_measured'] / max(ent['llm_cv_measured'], 1e-12):.2f}x lower (measured); "
        f"step {seq['step_seconds_measured'] / ent['step_seconds_measured']:.2f}x (measured), "
        f"{seq['step_seconds_simulated'] / ent['step_seconds_simulated']:.2f}x (simulated)"
    )
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is not installed: the table is the result
        log.warning("matplotlib not installed; no plot written")
        return None
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, key, title in (
        (axes[0], "encoder_fwd", "encoder forward"),
        (axes[1], "llm_fwd", "LLM forward"),
    ):
        for r in rows:
            ax.plot(np.array(r["series"][key]) * 1e3, label=r["method"], lw=1)
        ax.set_ylabel("ms")
        ax.set_title(f"per-microbatch {title} time (both ranks, in order)")
        ax.legend()
    axes[1].set_xlabel("microbatch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -------------------------------------------------------------------- main
def _demo_plan(table, spec: ModelSpec, args, calibration: dict | None = None) -> ParallelPlan:
    """The static plan of the demo: 2 data-parallel CPU ranks, one stage each."""
    cluster = Cluster(RANKS, gpus_per_node=RANKS, gpu_memory_gb=16.0)
    return make_plan(
        table,
        spec,
        cluster,
        args.global_batch,
        dp=RANKS,
        tp=1,
        pp=1,
        microbatches=args.microbatches,
        seed=args.seed,
        calibration=calibration,
    )


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run the demo (see the module docstring); returns the summary that it also writes."""
    from entrain_data.workers.demo_data import write_demo_dataset
    from entrain_data.workers.index_builder import build_index
    from tqdm import tqdm

    t_start = time.perf_counter()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = tqdm(total=5, desc="demo", unit="stage", dynamic_ncols=True)
    data = out / "data"
    stamp = data / "DATASET.json"
    want = {"samples": args.samples, "seed": args.seed, "shards": 4}
    stages.set_postfix_str("data")
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        shards = sorted(data.glob("demo-*.tar"))
    else:
        shards = write_demo_dataset(data, samples=args.samples, shards=4, seed=args.seed)
        stamp.write_text(json.dumps(want))
    stages.update()
    stages.set_postfix_str("index")
    index = out / "index.parquet"
    write_index(build_index([str(s) for s in shards], progress=True), index)
    table = read_index(index)
    stages.update()
    stages.set_postfix_str("profile + plan")
    spec = demo_model_spec()
    prof = macro_profile(table, spec, args.global_batch, batches=16, seed=args.seed)
    plan = _demo_plan(table, spec, args)
    stages.update()
    key_row = {str(k): i for i, k in enumerate(table.keys)}
    stages.set_postfix_str("train sequential")
    seq_runs = _train("sequential", plan, index, out, args)
    stages.update()
    # calibrate the cost model to this machine from the sequential run, plan again with it
    cal, fits = _calibrate(table, spec, seq_runs, key_row)
    plan = _demo_plan(table, spec, args, calibration=cal.to_dict())
    plan.save(out / "plan.json")
    stages.set_postfix_str("train entrain")
    ent_runs = _train("entrain", plan, index, out, args)
    stages.update()
    stages.close()
    costs = per_sample_costs(table, spec, calibration=cal)
    rows = [
        _summarise("sequential", seq_runs, costs, key_row),
        _summarise("entrain", ent_runs, costs, key_row),
    ]
    print()
    print(f"data: {len(table)} samples in {len(shards)} shards under {data}")
    print(prof.format_table())
    print()
    print(
        f"plan: dp={plan.dp} tp={plan.tp} pp={plan.pp}, {plan.microbatches} microbatches of "
        f"~{plan.global_batch / (plan.dp * plan.microbatches):.0f} samples, token cap {plan.max_tokens}, "
        f"deferral budget {plan.defer_budget}"
    )
    print(f"trained {rows[0]['steps']} steps per method on {RANKS} DDP ranks (gloo, CPU)")
    print(
        "cost model calibrated to the sequential run's forward times: "
        + ", ".join(
            f"{m} rel. RMS {f.rel_rms:.2f} (R^2 {f.r2:.2f}, {f.n} microbatches)"
            for m, f in fits.items()
        )
    )
    print()
    print(_table(rows))
    png = _plot(rows, out / "microbatch_loads.png")
    summary = {
        "rows": [{k: v for k, v in r.items() if k != "series"} for r in rows],
        "seconds": time.perf_counter() - t_start,
        "plot": str(png) if png else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nplot: {png}\nsummary: {out / 'summary.json'}  ({summary['seconds']:.0f} s)")
    return summary


def _cmd_demo(args: argparse.Namespace) -> int:
    run_demo(args)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the ``entrain-data`` parser."""
    p = subparsers.add_parser(
        "demo",
        help="end-to-end demo on generated data: index, profile, plan, serve, train 2 ranks",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--out",
        default="entrain-demo",
        metavar="DIR",
        help="where data, index, plans, results and the plot go (default: ./entrain-demo)",
    )
    p.add_argument("--samples", type=int, default=512, help="samples to generate (default 512)")
    p.add_argument(
        "--global-batch", type=int, default=64, help="samples per global batch (default 64)"
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="microbatches per rank per iteration (default 4)",
    )
    p.add_argument("--epochs", type=int, default=1, help="epochs per method (default 1)")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (default 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a training run may take before it is stopped (default 300)",
    )
    p.set_defaults(handler=_cmd_demo)
