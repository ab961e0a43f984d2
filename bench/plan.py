"""Static plan versus the per-batch oracle, and the price of a wrong static plan.

For every named synthetic workload, a few cluster sizes and global batches
(>= 256), runs the static planner and reports:

- ``oracle_gap``: how much slower the one static plan is, on average over the
  profiled global batches, than the best simulated layout chosen afresh for
  every batch (Entrain's claim: workload concentration makes one plan enough);
- ``next_layout_gap``: the throughput lost by the best simulated layout with
  another tp, pp or encoder/LLM stage split (a plausible wrong static choice);
- ``worst_static_gap``: the throughput lost by the worst simulated feasible
  static layout against the chosen one (the paper: up to 85%);
- the chosen layout with its data-parallel sharding and recomputed stages,
  expected iteration time against its balanced ideal, and the wall time of
  planning on this machine;
- ``without_new``: the expected iteration time of the plan made without the
  sharding and per-stage recomputation options (only the distributed
  optimizer, every stage recomputing when one does not fit: the planner before
  them), on the same profiled batches; ``gain`` = 1 - with / without. Both
  are the simulator's expectation; the options can only add candidates, so the
  plan with them is never slower by construction of the search, up to the
  simulation screen (checked per row).

Usage: ``python bench/plan.py [--quick] [--batches 8] [--llm qwen2.5-7b] [--out bench/results/plan.json]``.
Prints a table and writes JSON (one record per run).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from entrain_data.cost_model import per_sample_costs
from entrain_data.plan import Cluster
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.workloads import list_workloads, synthesize

log = logging.getLogger("bench.plan")

# (GPUs, global batch): all batches >= 256, as the target asks
SETUPS = ((64, 256), (256, 1024), (1024, 8192))
QUICK_SETUPS = ((64, 256), (256, 1024))
LLM = "llama-3.1-8b"


def model_for(name: str, table, llm: str = LLM) -> ModelSpec:
    """A vision encoder sized to the workload (+ Whisper when it has audio) and a 7-8B LLM."""
    vision = "siglip-so400m" if name == "llava-fixed" else "qwen2.5-vl-vision"
    encoders = [vision] + (["whisper-large-v3-encoder"] if len(table.audio_seconds) else [])
    return ModelSpec.from_names(encoders, llm)


def run(setups, batches: int, samples: int, seed: int, llm: str = LLM) -> list[dict]:
    rows = []
    for name in list_workloads():
        table = synthesize(name, samples, seed=seed)
        model = model_for(name, table, llm)
        costs = per_sample_costs(table, model)
        for gpus, gb in setups:
            t0 = time.perf_counter()
            plan = make_plan(
                table, model, Cluster(gpus), gb, batches=batches, seed=seed, costs=costs
            )
            seconds = time.perf_counter() - t0
            old = make_plan(
                table, model, Cluster(gpus), gb, batches=batches, seed=seed, costs=costs,
                shardings=("optimizer",), recompute="all",
            )  # fmt: skip
            rows.append(
                {
                    "workload": name,
                    "model": model.name,
                    "gpus": gpus,
                    "global_batch": gb,
                    "dp": plan.dp,
                    "tp": plan.tp,
                    "pp": plan.pp,
                    "microbatches": plan.microbatches,
                    "stages": [s.module for s in plan.stages],
                    "sharding": plan.sharding,
                    "recompute_stages": [s.index for s in plan.stages if s.recompute],
                    "memory_gb": max(plan.memory_gb),
                    "without_new": {
                        "dp": old.dp,
                        "tp": old.tp,
                        "pp": old.pp,
                        "microbatches": old.microbatches,
                        "sharding": old.sharding,
                        "recompute_stages": [s.index for s in old.stages if s.recompute],
                        "expected_iteration_time": old.expected_iteration_time,
                        "memory_gb": max(old.memory_gb),
                    },
                    "gain": 1.0 - plan.expected_iteration_time / old.expected_iteration_time,
                    "expected_iteration_time": plan.expected_iteration_time,
                    "ideal_iteration_time": plan.ideal_iteration_time,
                    "oracle_iteration_time": plan.search["oracle_iteration_time"],
                    "worst_iteration_time": plan.search["worst_iteration_time"],
                    "oracle_gap": plan.oracle_gap,
                    "next_layout_gap": _next_layout_gap(plan),
                    "worst_static_gap": plan.worst_static_gap,
                    "feasible_layouts": plan.search["feasible_layouts"],
                    "simulated_layouts": plan.search["simulated_layouts"],
                    "profiled_batches": batches,
                    "plan_seconds": seconds,
                }
            )
            log.info("%s %d GPUs B=%d done in %.1fs", name, gpus, gb, seconds)
    return rows


def _next_layout_gap(plan) -> float | None:
    """Throughput lost by the best simulated layout with another (tp, pp, encoder stages)."""
    sims = plan.search["simulated"]
    best = min(sims, key=lambda x: x["mean_time"])
    key = (best["tp"], best["pp"], best["encoder_stages"])
    others = [x["mean_time"] for x in sims if (x["tp"], x["pp"], x["encoder_stages"]) != key]
    return 1.0 - best["mean_time"] / min(others) if others else None


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'workload':<18} {'GPUs':>5} {'B':>5}  {'dp/tp/pp x M':<16} {'shard':<9} {'rc':<5} "
        f"{'iter s':>8} {'w/o new':>8} {'gain':>6} "
        f"{'ideal s':>8} {'oracle gap':>10} {'next loss':>9} {'worst loss':>10} {'layouts':>8} "
        f"{'plan s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        layout = f"{r['dp']}/{r['tp']}/{r['pp']} x {r['microbatches']}"
        rc = ",".join(map(str, r["recompute_stages"])) or "-"
        lines.append(
            f"{r['workload']:<18} {r['gpus']:>5} {r['global_batch']:>5}  {layout:<16} "
            f"{r['sharding']:<9} {rc:<5} {r['expected_iteration_time']:>8.3f} "
            f"{r['without_new']['expected_iteration_time']:>8.3f} {100 * r['gain']:>5.1f}% "
            f"{r['ideal_iteration_time']:>8.3f} "
            f"{100 * r['oracle_gap']:>9.2f}% {_pct(r['next_layout_gap']):>9} "
            f"{100 * r['worst_static_gap']:>9.1f}% "
            f"{r['feasible_layouts']:>8} {r['plan_seconds']:>7.2f}"
        )
    worst_gap = max(r["oracle_gap"] for r in rows)
    lines.append(
        f"largest static-vs-oracle gap {100 * worst_gap:.2f}% (target <= 2%); "
        f"largest loss of the worst feasible static plan "
        f"{100 * max(r['worst_static_gap'] for r in rows):.1f}%; sharding/recompute options: "
        f"gain {100 * min(r['gain'] for r in rows):.1f}% to {100 * max(r['gain'] for r in rows):.1f}%"
    )
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller clusters only (CI)")
    ap.add_argument("--batches", type=int, default=8, help="profiled global batches per plan")
    ap.add_argument("--samples", type=int, default=40000, help="samples synthesised per workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llm", default=LLM, help=f"LLM preset (default {LLM}; e.g. qwen2.5-7b)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    setups = QUICK_SETUPS if args.quick else SETUPS
    rows = run(setups, args.batches, args.samples, args.seed, args.llm)
    print(format_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setups": setups, "llm": args.llm, "runs": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
