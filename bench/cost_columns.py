"""The loader service's encoder cost columns against one summed column per stage group.

For two-encoder models (a vision tower and an audio tower), plans a few clusters with the
repository's planner and runs the loader service's schedule (``workers.schedule.Scheduler``,
as the coordinator builds it: cost columns, patches, patch cap, frozen flags, stage shares)
over one or more epochs of a synthetic table, twice on the same plan:

- ``columns``: what the service serves, ``plan.cost_columns()`` (encoders laid out alike over
  the stages summed, encoders laid out apart a column each) with the plan's shares;
- ``groups``: the baseline, one summed column per ``plan.encoder_groups()`` group (encoders
  that share any stage) with that group's shares: what the service balanced before this
  session, with the patches per group that f6d4f67 gave it (before that it refused plans
  whose encoders sit on separate stages).

Every iteration's assignment is simulated on the plan's own stages (1F1B, recomputation
included); the table prints the mean iteration time of each and their ratio (> 1: the
served columns are faster). Where both give one column, the two are the same assignment.

    python bench/cost_columns.py [--workload vision-audio] [--seeds 1,2] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entrain_data.workers.schedule import Scheduler  # noqa: E402

from entrain_data.assignment import assign  # noqa: E402
from entrain_data.cost_columns import group_columns  # noqa: E402
from entrain_data.cost_model import per_sample_costs  # noqa: E402
from entrain_data.dataset_profile import table_costs, table_encoder_stats  # noqa: E402
from entrain_data.plan import Cluster  # noqa: E402
from entrain_data.planner import make_plan  # noqa: E402
from entrain_data.presets import ModelSpec  # noqa: E402
from entrain_data.simulator import (  # noqa: E402
    simulate_pipeline,
    stage_sample_costs,
    stage_shares,
    times_from_sample_costs,
)
from entrain_data.workloads import synthesize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ENCODERS = ["qwen2.5-vl-vision", "whisper-large-v3-encoder"]
CLUSTERS = ((16, 256, 4), (32, 512, 4), (32, 512, 8))  # GPUs, global batch, pipeline depth


def served_time(plan, table, costs, columns: str, epochs: int) -> float:
    """Mean simulated iteration time of the service's stream under ``plan``."""
    enc, llm, tok = table_costs(table, plan, costs)
    patches, uses = table_encoder_stats(table, plan, costs)
    frozen = plan.frozen_columns()
    shares = plan.shares_for(enc.shape[1])
    if columns == "groups":
        groups = plan.encoder_groups()
        per_encoder = costs.encoder_cost()
        enc = group_columns(per_encoder, groups)
        patches = group_columns(costs.encoder_tokens.astype(np.int64), groups)
        shares = stage_shares(costs, plan.stages, groups, np.arange(len(llm)))
        model = plan.model_spec().encoders
        frozen = [all(model[i].frozen for i in g) for g in groups]
    got = []

    def spy(*args, **kw):
        got.append(assign(*args, **kw))
        return got[-1]

    s = Scheduler(
        enc, llm, tok, dp=plan.dp, microbatches=plan.microbatches,
        global_batch=plan.global_batch, max_tokens=plan.max_tokens,
        defer_budget=plan.defer_budget, method=plan.method, seed=0, assign_fn=spy,
        max_delay=plan.max_delay, max_encoder_patches=plan.max_encoder_patches or None,
        encoder_stats=(patches, uses), frozen_encoders=frozen if any(frozen) else None,
        pipeline_stages=plan.pp, stage_shares=shares,
    )  # fmt: skip
    per_stage = stage_sample_costs(costs, plan.stages)
    rc = np.array([st.recompute for st in plan.stages], dtype=float)
    times = []
    for ep in range(epochs):
        for it, rows in enumerate(s.batches(ep)):
            got.clear()
            s.slots(ep, it)
            f, b = times_from_sample_costs(got[0], per_stage, rows)
            times.append(simulate_pipeline(f, b + f * rc, plan.schedule).iteration_time)
    return float(np.mean(times))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="vision-audio")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--llms", default="llama-3.2-1b,llama-3.2-3b")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "cost_columns.json")
    a = p.parse_args(argv)
    rows = []
    print(
        "| seed | LLM | GPUs / batch / pp | frozen | layout | columns | groups s | columns s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for seed in (int(x) for x in a.seeds.split(",")):
        table = synthesize(a.workload, a.samples, seed)
        for llm in a.llms.split(","):
            for gpus, gb, pp in CLUSTERS:
                for frozen in (False, True):
                    spec = ModelSpec.from_names(ENCODERS, llm)
                    plan = make_plan(
                        table, spec, Cluster(gpus), gb, pp=pp, frozen_encoder=frozen, seed=0
                    )
                    costs = per_sample_costs(table, plan.model_spec(), calibration=plan.calibration)
                    t = {
                        c: served_time(plan, table, costs, c, a.epochs)
                        for c in ("groups", "columns")
                    }
                    r = {
                        "seed": seed, "llm": llm, "gpus": gpus, "global_batch": gb, "pp": pp,
                        "frozen": frozen, "stages": [st.module for st in plan.stages],
                        "columns": plan.cost_columns(), "groups_s": t["groups"],
                        "columns_s": t["columns"], "ratio": t["groups"] / t["columns"],
                    }  # fmt: skip
                    rows.append(r)
                    print(
                        f"| {seed} | {llm} | {gpus} / {gb} / {pp} | {frozen} | "
                        f"{'|'.join(r['stages'])} | {r['columns']} | {t['groups']:.4f} | "
                        f"{t['columns']:.4f} | {r['ratio']:.4f} |",
                        flush=True,
                    )
    apart = [r["ratio"] for r in rows if len(r["columns"]) > 1]
    if apart:
        print(
            f"\n{len(apart)} of {len(rows)} plans keep the encoders in separate columns: "
            f"ratio min {min(apart):.4f} mean {np.mean(apart):.4f} max {max(apart):.4f}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
