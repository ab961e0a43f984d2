"""How many loader cores a training node needs: what a node of 8 H100s consumes (from the plan and
the cost model) beside what one worker core delivers (measured: the default packer, decode +
resize + patchify + pack, in one process on the demo's shards of real JPEG/PNG/WAV files).

    python bench/node_demand.py [--samples 20000] [--global-batch 256] [--pack 96]

A node consumes ``global_batch / iteration time * 8 / world size`` samples per second at the
plan's expected iteration time; ``cores = consumed / delivered per core`` is the number of worker
processes (one core each) the node's service needs to never be what training waits for.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from entrain_data.demo.model import demo_model_spec
from entrain_data.workers.demo_data import write_demo_dataset
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.packing import make_packer

from entrain_data.metadata import write_index
from entrain_data.plan import Cluster
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.workloads import synthesize

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {
    "demo (entrain-data demo's tiny MLLM)": demo_model_spec(),
    "vl-1b-1280 (Qwen2.5-VL ViT, 1280-token cap + Llama-3.2-1B)": ModelSpec.from_names(
        ["qwen2.5-vl-vision-1280", "whisper-large-v3-encoder"], "llama-3.2-1b"
    ),
    "vl-1b (Qwen2.5-VL ViT + Llama-3.2-1B)": ModelSpec.from_names(
        ["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-1b"
    ),
}


def per_core(spec: ModelSpec, index: Path, n: int, per_mb: int = 8) -> float:
    """Samples per second one process packs with ``spec``'s preprocessing (after one warm-up)."""
    packer = make_packer(str(index), model=spec.to_dict())
    rows = list(range(n))
    packer(rows[:per_mb], rows[:per_mb])
    t0 = time.process_time()
    for i in range(0, n, per_mb):
        packer(rows[i : i + per_mb], rows[i : i + per_mb])
    return n / (time.process_time() - t0)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=20000, help="qwen2vl-dynamic samples to plan on")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--pack", type=int, default=96, help="demo samples packed per model")
    ap.add_argument("--out", default=str(RESULTS / "node_demand.json"))
    a = ap.parse_args(argv)
    table = synthesize("qwen2vl-dynamic", a.samples, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_demo_dataset(Path(tmp) / "data", samples=a.pack, shards=2, seed=0)
        index = write_index(
            build_index([str(s) for s in shards], progress=False), Path(tmp) / "i.parquet"
        )
        for name, spec in MODELS.items():
            plan = make_plan(table, spec, Cluster(8, 8, 80.0), a.global_batch, batches=4)
            consumed = a.global_batch / plan.expected_iteration_time
            delivered = per_core(spec, index, a.pack)
            rows.append(
                {
                    "model": name,
                    "layout": f"{plan.dp}/{plan.tp}/{plan.pp} x {plan.microbatches}",
                    "iteration_s": plan.expected_iteration_time,
                    "node_consumes_samples_s": consumed,
                    "core_delivers_samples_s": delivered,
                    "cores_per_node": consumed / delivered,
                }
            )
    head = f"{'model':<58} {'dp/tp/pp x M':>13} {'iter s':>8} {'node uses/s':>11} {'core packs/s':>12} {'cores':>7}"
    print(f"qwen2vl-dynamic, global batch {a.global_batch}, one node of 8 H100 (80 GB)")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<58} {r['layout']:>13} {r['iteration_s']:>8.3f} "
            f"{r['node_consumes_samples_s']:>11.1f} {r['core_delivers_samples_s']:>12.1f} "
            f"{r['cores_per_node']:>7.1f}"
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
