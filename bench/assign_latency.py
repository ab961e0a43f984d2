"""Assignment latency versus global batch size and dp: median wall and CPU time over repeats.

The loader runs the assignment ahead of training, once per iteration, so it
must stay far below an iteration (seconds). Costs come from the cost model on
the qwen2vl-dynamic workload (Qwen2.5-VL ViT + Llama-3.2-1B; ``--workload`` and ``--model``
choose others, comma-separated lists or ``all``: every synthetic workload and the real tables
of ../shared/data, the balance bench's models that can run it); the token cap, the
encoder patch cap and the deferral budget follow the planner's rule.

    python bench/assign_latency.py                     # every method, B 512..65536
    python bench/assign_latency.py --methods entrain --batches 8192 --dps 128 --microbatches 16
    python bench/assign_latency.py --methods entrain --batches 8192 --dps 128 --pp 4 \
        --workload all --model all                     # the balance bench's rows

Writes bench/results/assign_latency.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_MODELS,
    MODELS,
    RESULTS,
    caps,
    drawn_batch,
    model_costs,
    patch_caps,
    workload_names,
    workload_table,
)

from entrain_data.assignment import CAP_AWARE, METHODS, PATCH_CAP_AWARE, assign  # noqa: E402


def _measure(args, name: str, model: str, costs, sizes: list[int]) -> list[dict]:
    """Median wall and CPU ms of every method, batch size and dp on one workload and model."""
    out = []
    for method in args.methods.split(","):
        for b in sizes:
            for dp in (int(d) for d in args.dps.split(",")):
                m = args.microbatches
                if b < dp * m:
                    continue
                if method in ("megatron_dp_balanced", "wlb_llm") and b > 8192:
                    continue  # per-sample Python loops, as the peers' own code: minutes at 64k
                enc, llm, tok, pt = drawn_batch(costs, b, dp)  # real tables: small
                cap, budget = caps(tok, dp, m)
                pcap = patch_caps(pt, dp, m) if method in PATCH_CAP_AWARE else None
                kw = dict(
                    dp=dp,
                    microbatches=m,
                    defer_budget=budget,
                    method=method,
                    max_tokens=cap if method in CAP_AWARE else None,
                    encoder_patches=pt,
                    max_encoder_patches=pcap,
                    pipeline_stages=args.pp,
                    frozen_encoders=args.frozen_encoders,
                )
                wall, cpu = [], []
                for it in range(args.repeats):
                    t0, c0 = time.perf_counter(), time.process_time()
                    assign(enc, llm, tok, iteration=it, **kw)
                    wall.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                r = {
                    "workload": name,
                    "model": model,
                    "method": method,
                    "batch": b,
                    "dp": dp,
                    "microbatches": m,
                    "wall_ms_median": float(np.median(wall) * 1e3),
                    "cpu_ms_median": float(np.median(cpu) * 1e3),
                }
                out.append(r)
                print(
                    f"{name:24s} {model:11s} {method:22s} {b:6d} {dp:4d} {m:3d} "
                    f"{r['wall_ms_median']:9.1f} {r['cpu_ms_median']:8.1f}",
                    flush=True,
                )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="512,2048,8192,32768,65536")
    p.add_argument("--dps", default="4,32,128")
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--workload", default="qwen2vl-dynamic", help="names, comma-separated, or all")
    p.add_argument(
        "--model",
        default="vl-1b",
        help="of bench/_common.py's MODELS, or all (the balance bench's)",
    )
    p.add_argument("--pp", type=int, default=None, help="pipeline_stages entrain is told")
    p.add_argument("--frozen-encoders", action="store_true", help="encoders run forward only")
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batches.split(",")]
    known = workload_names()
    names = known if args.workload == "all" else args.workload.split(",")
    models = list(DEFAULT_MODELS) if args.model == "all" else args.model.split(",")
    unknown = [n for n in names if n not in known] + [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown workload or model {unknown} (real: ones need ../shared/data)")
    rows_out = []
    print(f"{'workload':24s} {'model':11s} {'method':22s} {'B':>6s} {'dp':>4s} {'M':>3s} "
          f"{'wall ms':>9s} {'cpu ms':>8s}")  # fmt: skip
    for name in names:
        table = workload_table(name, max(sizes))  # read or synthesised once, priced per model
        for model in models:
            costs = model_costs(model, table, frozen=args.frozen_encoders)
            if costs is None:
                if len(models) == 1:
                    p.error(f"model {model!r} has no encoder for {name!r}'s media")
                continue
            rows_out += _measure(args, name, model, costs, sizes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "assign_latency.json"
    out.write_text(json.dumps({"setting": vars(args), "results": rows_out}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
