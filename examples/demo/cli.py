"""``entrain-data demo``: run the whole system end to end (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from entrain_data.cost_model import per_sample_costs
from entrain_data.metadata import read_index, write_index
from entrain_data.plan import Cluster, ParallelPlan
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.profiler import macro_profile

from . import __doc__ as _package_doc
from . import report
from .model import RANKS, demo_model_spec
from .ranks import train

__all__ = ["register", "run_demo"]


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
    seq_runs = train("sequential", plan, index, out, args)
    stages.update()
    # calibrate the cost model to this machine from the sequential run, plan again with it
    cal, fits = report.calibrate_runs(table, spec, seq_runs, key_row)
    plan = _demo_plan(table, spec, args, calibration=cal.to_dict())
    plan.save(out / "plan.json")
    stages.set_postfix_str("train entrain")
    ent_runs = train("entrain", plan, index, out, args)
    stages.update()
    stages.close()
    costs = per_sample_costs(table, spec, calibration=cal)
    rows = [
        report.summarise("sequential", seq_runs, costs, key_row),
        report.summarise("entrain", ent_runs, costs, key_row),
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
    print(report.table(rows))
    print()
    print(report.microbatch_figure(seq_runs, ent_runs))
    png = report.plot(rows, out / "microbatch_loads.png")
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
        description=_package_doc.split("\n\n")[0],
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
