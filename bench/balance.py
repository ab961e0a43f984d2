"""Microbatch balance and simulated 1F1B iteration time of every assignment method.

For every named workload (and the real tables in ../shared/data when present)
and each model (the paper's Qwen2.5-VL ViT + Llama-3.2-1B; a vision + audio +
LLM model), draws K global batches, assigns them with every method and reports:
CV of per-microbatch encoder and LLM load, per-stage CV of stage time, the
simulated 1F1B iteration time, its ratio to the ideal (every microbatch at its
stage's mean), and throughput (training work consumed per simulated second) versus
``sequential`` and versus the best peer. ``wlb_llm`` delays outliers: its
carried samples are prepended to the next batch (its outlier queue), and the
last iteration flushes the queue (``assign(..., flush=True)``, the end of a
run), so every method trains the same samples in the same number of
iterations. Without the flush a queue that has not filled by the last
iteration is never trained, and the window credits the method for skipping
its heaviest samples.

``entrain_d2`` is entrain with ``max_delay=2`` (opt-in bounded delay: heavy samples wait up
to two iterations, carried and aged the same way; ``--max-delay K`` another bound, the row
keeping its name). Per row the header gives the best peer,
the best peer that keeps samples in their iteration (megatron_dp_balanced, verl_kk,
orchmllm, disttrain) and the whole-sample bound on the busiest stage (the largest sample
over a mean microbatch, and the LPT lower bound on the largest microbatch); per method,
``vsKeep`` is the throughput over the best keeping peer's, ``maxTok`` / ``maxPt`` the
largest LLM set in tokens and encoder set in patches (entrain honours both caps, the patch
cap by the token cap's rule); a summary checks the issue's claims over every row.
Entrain is told the pipeline depth (``assign(pipeline_stages=--pp)``) and the stage layout
the simulator runs (``assign(stage_shares=)``, each module's share on every stage, measured
on the drawn batches as the planner measures its profiled ones), as the loader service
passes its plan's; ``--no-stage-shares`` tells it the depth only, ``--proxy-stages``
another depth and no layout (0: no depth either, its default), to measure callers that do
not pass the plan's.

    python bench/balance.py                       # paper setting: B=512, dp=4, M=32
    python bench/balance.py --batch 4096 --dp 16 --microbatches 16
    python bench/balance.py --frozen-encoders --tag frozen    # encoders forward only
    python bench/balance.py --pp 8 --proxy-stages 0 --tag pp8-untold
    python bench/balance.py --no-stage-shares --tag depth-only   # told pp, not the layout
    python bench/balance.py --sim-cost convex --tag convex   # costs the methods do not see
    python bench/balance.py --mixes --workloads mix:chat,mix:docs  # mixes of the real corpora

``--sim-cost`` runs the simulator on costs the assignment is not given (every method still
assigns on the cost model's): ``per-sample`` adds 10% of a mean sample's stage cost to every
sample that uses the stage, ``per-microbatch`` 10% of a mean microbatch's stage time to every
microbatch that has work there (a kernel launch's fixed share), ``convex`` adds
``0.3 * mean * min((t / mean - 1)^2, 0.25)`` to each microbatch's stage time ``t``: light
and heavy microbatches both cost more than the line, as the GPU runs' residuals show
(bench/RESULTS.md, "On a GPU": +2-4% of a microbatch at the lightest and heaviest fifths),
and the penalty stops growing half a mean microbatch from the mean, where those runs
measured nothing (a quadratic there would charge a clip of 6x a mean microbatch 7.5 more;
the cost model already holds attention's quadratic term). ``mean`` is the run's mean
microbatch (the table's mean sample times the samples a microbatch holds), the same for
every method and iteration: a GPU's efficiency curve does not move with the batch. A
method whose lead lives in the cost model only loses it there.

Writes bench/results/balance[-TAG].json and balance[-TAG].png.
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
    model_costs,
    patch_caps,
    pick_stages,
    tables,
)

from entrain_data.assignment import (  # noqa: E402
    CAP_AWARE,
    DEFERRING,
    METHODS,
    PATCH_CAP_AWARE,
    assign,
    check_assignment,
)
from entrain_data.errors import InvalidInput  # noqa: E402
from entrain_data.metrics import microbatch_loads, stage_cv  # noqa: E402
from entrain_data.presets import ModelSpec  # noqa: E402
from entrain_data.simulator import (  # noqa: E402
    ideal_iteration_time,
    simulate_pipeline,
    stage_sample_costs,
    stage_shares,
    times_from_sample_costs,
)

PEERS = tuple(m for m in METHODS if m != "entrain")
# peers that keep every sample in its iteration (entrain's default contract)
KEEPING = ("megatron_dp_balanced", "verl_kk", "orchmllm", "disttrain")
DELAY = 2  # max_delay of the bench's "entrain_d2" row
BENCH_METHODS = METHODS + ("entrain_d2",)
SIM_COSTS = ("linear", "per-sample", "per-microbatch", "convex")
_OFF_MODEL = 0.1  # per-sample / per-microbatch: this share of a mean one's stage cost added
_CONVEX = 0.3  # convex: this times mean * (t / mean - 1)^2 added
_CONVEX_RANGE = 0.5  # ... up to this distance from the mean (the GPU runs' range)


def sim_stage_costs(per_stage: tuple, kind: str) -> tuple:
    """The per-sample stage costs the simulator runs on (``kind`` ``per-sample``: every
    sample that uses a stage pays a fixed share of a mean sample's there)."""
    if kind != "per-sample":
        return per_stage
    out = []
    for x in per_stage:
        used = x > 0
        mean = np.where(used, x, 0.0).sum(axis=0) / np.maximum(used.sum(axis=0), 1)
        out.append(np.where(used, x + _OFF_MODEL * mean, x))
    return tuple(out)


def mean_microbatch(per_stage: tuple, per_mb: float) -> tuple[np.ndarray, np.ndarray]:
    """[S] forward and backward stage time of the run's mean microbatch: the mean sample
    of the table (``per_stage``, :func:`stage_sample_costs`) times ``per_mb`` samples."""
    ef, eb, lf, lb = per_stage
    return (ef + lf).mean(axis=0) * per_mb, (eb + lb).mean(axis=0) * per_mb


def sim_times(f: np.ndarray, b: np.ndarray, kind: str, ref=None) -> tuple[np.ndarray, np.ndarray]:
    """[R, M, S] forward and backward stage times as the simulator runs them (see the module
    docstring's ``--sim-cost``; ``ref``: :func:`mean_microbatch`); microbatches without work
    on a stage stay free."""
    if kind not in ("per-microbatch", "convex"):
        return f, b
    out = []
    for t, mean in zip((f, b), ref, strict=True):
        if kind == "per-microbatch":
            extra = _OFF_MODEL * mean
        else:
            off = (t / np.where(mean > 0, mean, 1.0) - 1) ** 2
            extra = _CONVEX * mean * np.minimum(off, _CONVEX_RANGE**2)
        out.append(np.where(t > 0, t + extra, t))
    return out[0], out[1]


def run_method(
    name,
    costs,
    per_stage,
    batches,
    dp,
    m,
    seed,
    frozen=False,
    pp=None,
    sim="linear",
    shares=None,
    max_delay=DELAY,
):
    """K iterations of one method; returns summary figures and the per-iteration loads.
    ``pp``: the pipeline depth entrain is told (``assign(pipeline_stages=)``; None: its
    default); ``shares``: the stage layout it is told (``assign(stage_shares=)``; None:
    none); ``sim``: the costs the simulator runs (:data:`SIM_COSTS`); ``max_delay``: the
    ``entrain_d2`` row's."""
    sim_stage = sim_stage_costs(per_stage, sim)
    ref = mean_microbatch(per_stage, len(batches[0]) / (dp * m))
    method = "entrain" if name == "entrain_d2" else name
    delay = max_delay if name == "entrain_d2" else 0
    enc_all = costs.encoder_cost()
    llm_all = costs.llm_cost()
    tok_all = costs.llm_tokens
    pt_all = costs.encoder_tokens.astype(np.int64)  # [N, E] encoder patches
    carried_rows = np.zeros(0, np.int64)
    carried_age = np.zeros(0, np.int64)
    cv_e, cv_l, st_cv, times, ideals, lat, loads = [], [], [], [], [], [], []
    max_tok = max_pt = uncapped = 0
    consumed = 0
    work = 0.0
    sample_work = enc_all.sum(axis=1) + llm_all
    for it, fresh in enumerate(batches):
        rows = np.concatenate([carried_rows, fresh])
        ages = np.concatenate([carried_age, np.zeros(len(fresh), np.int64)])
        enc, llm, tok, pt = enc_all[rows], llm_all[rows], tok_all[rows], pt_all[rows]
        cap, budget = caps(tok, dp, m)
        cap_m = cap if method in CAP_AWARE else None
        pcap = patch_caps(pt, dp, m) if method in PATCH_CAP_AWARE else None
        kw = dict(dp=dp, microbatches=m, defer_budget=budget, method=method, seed=seed)
        kw.update(frozen_encoders=frozen)  # entrain's pipeline proxy: no encoder backward
        kw.update(pipeline_stages=pp, stage_shares=shares)  # and the plan's pp and stages
        kw.update(iteration=it, flush=it == len(batches) - 1, max_delay=delay, ages=ages)
        kw.update(encoder_patches=pt)
        t0 = time.perf_counter()
        try:
            a = assign(enc, llm, tok, max_tokens=cap_m, max_encoder_patches=pcap, **kw)
        except InvalidInput:  # e.g. original-order packing cannot meet the cap: its own capacity
            cap_m = pcap = None
            uncapped += 1
            a = assign(enc, llm, tok, **kw)
        lat.append(time.perf_counter() - t0)
        check_assignment(
            a, len(rows), tok, cap_m, budget if method in DEFERRING else None, pt, pcap
        )
        max_tok = max(max_tok, max(int(tok[s].sum()) for row in a.llm_sets for s in row))
        max_pt = max(max_pt, max(int(pt[s].sum()) for row in a.encoder_sets for s in row))
        carried_age = ages[a.carried] + 1
        carried_rows = rows[a.carried]
        consumed += len(rows) - len(a.carried)
        work += float(sample_work[rows].sum() - sample_work[carried_rows].sum())
        ml = microbatch_loads(a, enc, llm)
        cv = ml.cv()
        cv_e.append(cv["encoder"])
        cv_l.append(cv["llm"])
        f, b = sim_times(*times_from_sample_costs(a, sim_stage, rows=rows), sim, ref)
        st_cv.append(stage_cv(f, b))
        times.append(simulate_pipeline(f, b).iteration_time)
        ideals.append(ideal_iteration_time(f, b))
        loads.append((ml.encoder[0].tolist(), ml.llm[0].tolist()))
    total = float(np.sum(times))
    return {
        "cv_encoder": float(np.mean(cv_e)),
        "cv_llm": float(np.mean(cv_l)),
        "stage_cv": np.mean(st_cv, axis=0).tolist(),
        "iteration_time": float(np.mean(times)),
        "ideal_time": float(np.mean(ideals)),
        "ratio_to_ideal": float(np.sum(times) / np.sum(ideals)),
        "samples": int(consumed),
        "samples_per_s": consumed / total if total > 0 else 0.0,
        # training work consumed per simulated second: carried samples count when trained
        "throughput": work / total if total > 0 else 0.0,
        "assign_ms_median": float(np.median(lat) * 1e3),
        "carried_at_end": int(len(carried_rows)),
        "max_mb_tokens": max_tok,  # largest LLM set, tokens
        "max_mb_patches": max_pt,  # largest encoder set, patches (all encoders)
        "iterations_uncapped": uncapped,
    }, loads


def whole_sample_bound(per_stage, batches, dp, m) -> dict:
    """What no method keeping samples whole can beat, on the busiest stage of each batch:
    the largest sample's load over a mean microbatch's, and the LPT lower bound on the
    largest microbatch (max of the mean, the largest sample, and the two samples that
    must share a microbatch when there are more samples than microbatches), both over
    the mean microbatch load; means over the batches."""
    c = sum(per_stage)  # [N, S] forward + backward per stage
    bins = dp * m
    big, lb = [], []
    for rows in batches:
        x = c[rows]
        s = int(np.argmax(x.sum(axis=0)))
        v = np.sort(x[:, s])[::-1]
        mean = v.sum() / bins
        pair = v[bins - 1] + v[bins] if len(v) > bins else 0.0
        big.append(v[0] / mean)
        lb.append(max(mean, v[0], pair) / mean)
    return {"max_sample_over_mean_mb": float(np.mean(big)), "lpt_bound": float(np.mean(lb))}


def bench_one(name, table, model_name, args):
    costs = model_costs(model_name, table, frozen=args.frozen_encoders)
    if costs is None:
        return None
    rng = np.random.default_rng([args.seed, 7])
    replace = len(table) < args.batch
    batches = [rng.choice(len(table), args.batch, replace=replace) for _ in range(args.iterations)]
    encs, llm = MODELS[model_name]
    model = ModelSpec.from_names(list(encs), llm, frozen_encoders=args.frozen_encoders)
    stages = pick_stages(model, costs, np.stack(batches), args.pp)
    per_stage = stage_sample_costs(costs, stages)
    told = args.proxy_stages is None and not args.no_stage_shares
    shares = stage_shares(costs, stages, rows=np.unique(np.stack(batches))) if told else None
    res, loads = {}, {}
    for method in BENCH_METHODS:
        res[method], loads[method] = run_method(
            method,
            costs,
            per_stage,
            batches,
            args.dp,
            args.microbatches,
            args.seed,
            args.frozen_encoders,
            args.pp if args.proxy_stages is None else (args.proxy_stages or None),
            args.sim_cost,
            shares,
            args.max_delay,
        )
    seq = res["sequential"]
    best_peer = max(PEERS, key=lambda k: res[k]["throughput"])
    best_keep = max(KEEPING, key=lambda k: res[k]["throughput"])
    for v in res.values():
        v["vs_sequential_cv_encoder"] = seq["cv_encoder"] / max(v["cv_encoder"], 1e-12)
        v["vs_sequential_cv_llm"] = seq["cv_llm"] / max(v["cv_llm"], 1e-12)
        v["speedup_vs_sequential"] = v["throughput"] / seq["throughput"]
        v["speedup_vs_best_peer"] = v["throughput"] / res[best_peer]["throughput"]
        v["speedup_vs_best_keeping_peer"] = v["throughput"] / res[best_keep]["throughput"]
    return {
        "workload": name,
        "model": model_name,
        "modules": list(model.module_names),
        "stages": [st.module for st in stages],
        "best_peer": best_peer,
        "best_keeping_peer": best_keep,
        "bound": whole_sample_bound(per_stage, batches, args.dp, args.microbatches),
        "methods": res,
    }, loads


def print_table(r) -> None:
    bd = r["bound"]
    print(
        f"\n== {r['workload']}  model={r['model']}  stages={'|'.join(r['stages'])}  "
        f"best peer={r['best_peer']}  best keeping peer={r['best_keeping_peer']}  "
        f"bound: max sample/mean mb={bd['max_sample_over_mean_mb']:.3f} "
        f"LPT={bd['lpt_bound']:.3f}"
    )
    print(
        f"{'method':22s} {'cvE':>7s} {'cvL':>7s} {'xSeqE':>6s} {'xSeqL':>6s} {'stageCV':>22s} "
        f"{'T(s)':>8s} {'T/ideal':>8s} {'vsSeq':>6s} {'vsBest':>7s} {'vsKeep':>7s} {'ms':>6s} "
        f"{'carried':>7s} {'maxTok':>7s} {'maxPt':>7s}"
    )
    for k, v in r["methods"].items():
        scv = ",".join(f"{x:.2f}" for x in v["stage_cv"])
        print(
            f"{k:22s} {v['cv_encoder']:7.4f} {v['cv_llm']:7.4f} "
            f"{v['vs_sequential_cv_encoder']:6.2f} {v['vs_sequential_cv_llm']:6.2f} {scv:>22s} "
            f"{v['iteration_time']:8.3f} {v['ratio_to_ideal']:8.4f} "
            f"{v['speedup_vs_sequential']:6.3f} {v['speedup_vs_best_peer']:7.4f} "
            f"{v['speedup_vs_best_keeping_peer']:7.4f} "
            f"{v['assign_ms_median']:6.1f} {v['carried_at_end']:7d} {v['max_mb_tokens']:7d} "
            f"{v['max_mb_patches']:7d}{'  (uncapped)' if v['iterations_uncapped'] else ''}"
        )


def summary(out) -> None:
    """The issue's checks over every row: ratios, CVs against sequential, T/ideal, caps."""
    if not out:
        return
    keep = [r["methods"]["entrain"]["speedup_vs_best_keeping_peer"] for r in out]
    d2 = [r["methods"]["entrain_d2"]["speedup_vs_best_peer"] for r in out]
    print(
        f"\nentrain vs best keeping peer: min {min(keep):.4f} mean {np.mean(keep):.4f}; "
        f"rows below 1.000: {sum(k < 1 for k in keep)}/{len(keep)}"
    )
    print(
        f"entrain_d2 vs best peer (wlb_llm included): min {min(d2):.4f} mean {np.mean(d2):.4f}; "
        f"rows below 1.000: {sum(k < 1 for k in d2)}/{len(d2)}"
    )
    for k in ("cv_encoder", "cv_llm", "max_mb_tokens", "max_mb_patches"):
        strict = k.startswith("cv")  # CVs must be below sequential's, sizes not above
        bad = []
        for r in out:
            e, q = r["methods"]["entrain"][k], r["methods"]["sequential"][k]
            if e > q or (strict and e >= q and q > 1e-9):  # 0 against 0: nothing to even
                bad.append(f"{r['workload']}/{r['model']}")
        word = "not below" if strict else "above"
        print(f"entrain {k} {word} sequential's on: {', '.join(bad) or 'no row'}")
    over = [
        f"{r['workload']}/{r['model']} ({r['methods']['entrain']['ratio_to_ideal']:.3f}, "
        f"LPT bound {r['bound']['lpt_bound']:.3f})"
        for r in out
        if r["methods"]["entrain"]["ratio_to_ideal"] > 1.03
    ]
    print(f"entrain T/ideal > 1.03 on: {'; '.join(over) or 'no row'}")


def plot(loads, title, path: Path, iterations: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for method, style in (("sequential", "-"), ("entrain", "-")):
        e = np.concatenate([np.asarray(x[0]) for x in loads[method][:iterations]])
        ll = np.concatenate([np.asarray(x[1]) for x in loads[method][:iterations]])
        axes[0].plot(e, style, label=method, drawstyle="steps-mid")
        axes[1].plot(ll, style, label=method, drawstyle="steps-mid")
    axes[0].set_ylabel("encoder load (s)")
    axes[1].set_ylabel("LLM load (s)")
    axes[1].set_xlabel(f"microbatch of replica 0 ({iterations} iterations)")
    axes[0].set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument(
        "--proxy-stages",
        type=int,
        default=None,
        help="pipeline depth entrain is told (default: --pp; 0: not told, assign's default)",
    )
    p.add_argument(
        "--no-stage-shares",
        action="store_true",
        help="tell entrain the depth only, not the plan's stage layout (assign(stage_shares=))",
    )
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument(
        "--sim-cost",
        choices=SIM_COSTS,
        default="linear",
        help="costs the simulator runs that the methods do not see (default: the cost model's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-delay",
        type=int,
        default=DELAY,
        help=f"max_delay of the entrain_d2 row (default {DELAY}, the issue's; it keeps its name)",
    )
    p.add_argument("--workloads", default="", help="comma-separated subset (default: all)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--no-real", action="store_true", help="skip the real tables")
    p.add_argument(
        "--mixes",
        action="store_true",
        help="also mixes of the real corpora (_common.MIXES, rows mix:NAME)",
    )
    p.add_argument("--tag", default="")
    p.add_argument(
        "--frozen-encoders", action="store_true", help="encoders run forward only (no backward)"
    )
    args = p.parse_args(argv)
    pool = max(args.batch * args.iterations * 2, 16384)
    all_tables = tables(pool, args.seed, real=not args.no_real, mixes=args.mixes)
    wanted = [w for w in args.workloads.split(",") if w]
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.tag}" if args.tag else ""
    out, plotted = [], False
    for name, table in all_tables.items():
        if wanted and name not in wanted:
            continue
        for model_name in args.models.split(","):
            got = bench_one(name, table, model_name, args)
            if got is None:
                continue
            r, loads = got
            print_table(r)
            out.append(r)
            if not plotted and name == "qwen2vl-dynamic":
                plot(
                    loads,
                    f"{name}, {model_name}: B={args.batch} dp={args.dp} M={args.microbatches}",
                    RESULTS / f"balance{suffix}.png",
                )
                plotted = True
    summary(out)
    doc = {"setting": vars(args), "results": out}
    (RESULTS / f"balance{suffix}.json").write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {RESULTS / f'balance{suffix}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
