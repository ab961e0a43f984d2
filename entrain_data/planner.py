"""The static planner: search feasible layouts, score them on profiled batches, pick one.

Inputs are the cluster, the model, the global batch and a sample table (or a
macro profile of it). Every layout (tp, pp, dp, how pipeline stages are split
between the encoders and the LLM, each stage's layer ranges, microbatches per
iteration) whose memory estimate fits is first scored analytically
(``(M + S - 1) * slowest stage``, plus communication), then the best few and
the worst are simulated with the Entrain assignment on every profiled global
batch. The plan is the layout with the lowest mean simulated iteration time;
the per-batch oracle picks the best simulated layout afresh for every batch,
and ``oracle_gap`` is how much slower the static choice is on average.

Model of time: :mod:`.plan_time`; of memory: :mod:`.plan_layout`. Every
layout is tried with each data-parallel sharding (``none``, ``optimizer``,
``gradients``, ``full``); a stage whose memory does not fit recomputes its
activations (only that stage: recomputation costs time and frees memory, so
a stage that fits without it never takes it). Sharding and recomputation are
then scored like every other choice, analytically and in the simulation.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

import numpy as np

from .cost_model import SampleCosts, per_sample_costs
from .errors import InvalidInput, PlanError
from .metadata import SampleTable
from .plan import SHARDING, Cluster, ParallelPlan, StagePlan
from .plan_layout import layer_units, memory_gb, stage_params, stages_for
from .plan_scoring import (
    Candidate,
    PlanContext,
    cap_need,
    caps,
    ideal,
    patch_cap,
    simulate,
    to_simulate,
)
from .plan_time import (
    RECOMPUTE_SLOWDOWN,
    gather_times,
    group_bandwidth,
    stage_overheads,
    sync_time,
    tp_speedup,
)
from .presets import ModelSpec
from .profiler import MacroProfile
from .simulator import (
    SCHEDULES,
)
from .token_caps import (
    cap_rule,
    check_token_cap,
    count_floor,
    heavy_batches,
    pinned_cap_error,
)

__all__ = [
    "make_plan",
    "MEMORY_HEADROOM",
    "RECOMPUTE",
]

log = logging.getLogger(__name__)

MEMORY_HEADROOM = 0.9  # share of GPU memory the plan may use
MAX_STAGES = 32  # deepest pipeline searched


RECOMPUTE = ("stage", "all", "always", "never")
"""``make_plan(recompute=...)``: which stages recompute their activations (see make_plan)."""


def _recomputed(mode: str, need: tuple[bool, ...]) -> tuple[bool, ...]:
    """Stages that recompute under ``mode``, given those that do not fit without it."""
    n = len(need)
    if mode == "all":
        return (any(need),) * n
    return {"always": (True,) * n, "never": (False,) * n}.get(mode, need)


def _analytic(
    stages, tp, dp, m, cluster, model, mean_tokens_mb, params, rc, sharding, costs=None
) -> float:
    """``(M + S - 1)`` x the slowest stage's mean microbatch (+ weight gathers not hidden by
    compute, + its forward and backward call overheads as the simulation adds them, + p2p),
    plus the per-iteration DP collectives."""
    loads = np.array([st.expected_load for st in stages]) / (dp * m) / tp_speedup(tp)
    loads = loads * np.where(rc, RECOMPUTE_SLOWDOWN, 1.0)
    loads = np.maximum(loads, 2 * gather_times(params, tp, dp, cluster, sharding))
    over_f, over_b = stage_overheads(costs, stages, rc)
    pp = len(stages)
    p2p = 2 * mean_tokens_mb * model.llm.hidden * 2 / group_bandwidth(cluster, tp * pp)
    per_mb = (loads + over_f + over_b).max() + (p2p if pp > 1 else 0.0)
    return (m + pp - 1) * per_mb + sync_time(params, tp, dp, cluster, sharding)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_plan(
    table: SampleTable,
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int | None = None,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    microbatches: int | None = None,
    frozen_encoder: bool = False,
    batches: int = 8,
    seed: int = 0,
    schedule: str = "1f1b",
    simulate_top: int = 4,
    calibration: dict | None = None,
    costs: SampleCosts | None = None,
    profile: MacroProfile | None = None,
    max_tokens: int | None = None,
    shardings: tuple[str, ...] = SHARDING,
    recompute: str = "stage",
) -> ParallelPlan:
    """Search the feasible layouts for ``model`` on ``cluster`` and return the static plan.

    ``profile`` (a :class:`~entrain_data.profiler.MacroProfile` of ``table``)
    supplies the global batches to score on; otherwise ``batches`` global
    batches of ``global_batch`` samples are drawn with ``seed``. ``dp``, ``tp``,
    ``pp`` and ``microbatches`` pin parts of the layout; ``max_tokens`` pins the LLM token cap of
    a microbatch (else it is derived so that every global batch of the index fits).
    ``shardings``: the data-parallel shardings tried; ``recompute``: ``"stage"`` (each stage that
    does not fit recomputes), ``"all"`` (every stage, when one does not fit: the planner before
    per-stage recomputation, for comparisons), ``"always"`` (every stage, pinned) or ``"never"``
    (layouts that need it are dropped). Raises
    :class:`~entrain_data.errors.PlanError` naming why when nothing fits.
    """
    t0 = time.perf_counter()
    if frozen_encoder:
        model = replace(model, encoders=tuple(e.with_frozen() for e in model.encoders))
    idx = _profiled_batches(table, global_batch, batches, seed, profile)
    batches, global_batch = idx.shape
    bad = [x for x in shardings if x not in SHARDING] or ([] if shardings else ["(none)"])
    if bad or recompute not in RECOMPUTE:
        raise InvalidInput(
            f"shardings {bad} / recompute {recompute!r}: choose from {SHARDING} / {RECOMPUTE}"
        )
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("microbatches", microbatches)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise InvalidInput(f"{name} must be a positive integer, got {v!r}")
    if schedule not in SCHEDULES:
        raise InvalidInput(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    costs = costs if costs is not None else per_sample_costs(table, model, calibration=calibration)
    tok = costs.llm_tokens.astype(np.int64)
    check_token_cap(table.keys, tok, max_tokens)
    patches = (
        costs.encoder_tokens.sum(axis=1).astype(np.int64)
        if costs.encoder_tokens.size
        else np.zeros(len(tok), dtype=np.int64)
    )
    heavy_tok, tok_order = heavy_batches(tok, global_batch, seed)
    heavy_pt, pt_order = heavy_batches(patches, global_batch, seed)
    ctx = PlanContext(
        model,
        cluster,
        global_batch,
        tok[idx],
        int(tok.max()),
        _enc_tokens(costs, idx),
        heavy_tok,
        max_tokens,
        heavy_pt,
        int(patches.max(initial=0)),
        _order(tok[idx], tok_order),
        _order(patches[idx], pt_order),
    )
    cands, (smallest_need, least_at), cap_short = _candidates(
        ctx,
        layer_units(model, costs, idx),
        dp,
        tp,
        pp,
        microbatches,
        schedule,
        shardings,
        recompute,
        costs,
    )
    if not cands:
        if cap_short is not None and smallest_need is math.inf:
            raise pinned_cap_error(max_tokens, *cap_short, microbatches is not None)
        if smallest_need is math.inf and dp and microbatches and dp * microbatches > global_batch:
            raise PlanError(
                f"global batch {global_batch} < dp {dp} x microbatches {microbatches}: every "
                "microbatch needs at least one sample; lower microbatches or raise the batch"
            )
        if smallest_need is math.inf:
            pins = "".join(  # only those given: "dp=None" says nothing
                f", {k}={v}"
                for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("microbatches", microbatches))
                if v is not None
            )
            raise PlanError(
                f"no layout of {cluster.world_size} GPUs meets the constraints (global batch "
                f"{global_batch}{pins}): "
                "dp must divide the global batch, tp*pp*dp equal the GPU count, and the global "
                "batch hold at least dp * microbatches samples"
            )
        long = "" if max_tokens else _long_samples(ctx, table.keys, tok, *least_at)
        raise PlanError(
            f"model {model.name or model.llm.name!r} fits no layout of {cluster.world_size} GPUs: "
            f"the smallest needs {smallest_need:.1f} GB per GPU, "
            f"{MEMORY_HEADROOM * cluster.gpu_memory_gb:.1f} GB usable of {cluster.gpu_memory_gb:g} GB"
            f"{long}"
        )
    chosen = to_simulate(cands, simulate_top)
    chosen, sims, means_fb = simulate(ctx, chosen, costs, idx, seed, schedule)
    means = np.nanmean(sims, axis=1)
    full = ~np.isnan(sims).any(axis=1)  # simulated on every batch (the best always is)
    best, worst = int(np.argmin(np.where(full, means, np.inf))), int(np.argmax(means))
    oracle = np.nanmin(sims, axis=0).mean()
    c = chosen[best]
    cap, budget = caps(ctx, c.dp, c.microbatches)
    elapsed = time.perf_counter() - t0
    log.info("planned %d candidates (%d simulated) in %.2fs", len(cands), len(chosen), elapsed)
    plan = ParallelPlan(
        world_size=cluster.world_size,
        gpus_per_node=cluster.gpus_per_node,
        dp=c.dp,
        tp=c.tp,
        pp=c.pp,
        stages=tuple(
            StagePlan(
                s.index,
                s.segments,
                s.expected_load / (c.dp * c.microbatches) / tp_speedup(c.tp),
                rc,
            )
            for s, rc in zip(c.stages, c.recompute)
        ),
        microbatches=c.microbatches,
        global_batch=global_batch,
        max_tokens=cap,
        defer_budget=budget,
        max_encoder_patches=patch_cap(ctx, c.dp, c.microbatches),
        schedule=schedule,
        expected_iteration_time=float(means[best]),
        ideal_iteration_time=ideal(means_fb[best], c.microbatches, schedule),
        oracle_gap=float(means[best] / oracle - 1.0),
        worst_static_gap=float(1.0 - means[best] / means[worst]),
        memory_gb=c.memory_gb,
        recompute=any(c.recompute),
        sharding=c.sharding,
        model=model.to_dict(),
        calibration=calibration
        if isinstance(calibration, dict) or calibration is None
        else calibration.to_dict(),
        search={
            "feasible_layouts": len(cands),
            "simulated_layouts": len(chosen),
            "profiled_batches": batches,
            "seed": seed,
            "seconds": elapsed,
            "oracle_iteration_time": float(oracle),
            "worst_iteration_time": float(means[worst]),
            "simulated": [
                {
                    "tp": x.tp,
                    "pp": x.pp,
                    "dp": x.dp,
                    "microbatches": x.microbatches,
                    "encoder_stages": x.encoder_stages,
                    "recompute": list(x.recompute),
                    "sharding": x.sharding,
                    "stages": [s.module for s in x.stages],
                    "analytic_time": x.analytic_time,
                    "mean_time": float(mt),
                    "batch_times": [None if np.isnan(v) else float(v) for v in row],
                }
                for x, mt, row in zip(chosen, means, sims)
            ],
        },
    )
    # the layout as the service tells entrain's assignment (its proxy prices on it)
    return plan.with_stage_shares(costs, np.unique(idx))


def _profiled_batches(
    table: SampleTable,
    global_batch: int | None,
    batches: int,
    seed: int,
    profile: MacroProfile | None,
) -> np.ndarray:
    """[K, B] table rows of the global batches the plan is scored on."""
    if profile is not None:
        idx = np.asarray(profile.batch_indices, dtype=np.int64)
        if idx.ndim != 2 or idx.size == 0:
            raise InvalidInput("profile: holds no batch indices (profile with include_batches)")
        if idx.max() >= len(table):
            raise InvalidInput(
                f"profile: batch indices reach row {int(idx.max())} but {table.origin} has "
                f"{len(table)} samples (a profile of another index?)"
            )
        if global_batch is not None and global_batch != idx.shape[1]:
            raise InvalidInput(
                f"global_batch {global_batch} differs from the profile's {idx.shape[1]}"
            )
        return idx
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise InvalidInput(f"global_batch must be a positive integer, got {global_batch!r}")
    if global_batch > len(table):
        raise InvalidInput(
            f"global_batch {global_batch} exceeds the {len(table)} samples of {table.origin}"
        )
    if not isinstance(batches, int) or batches < 1:
        raise InvalidInput(f"batches must be a positive integer, got {batches!r}")
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(len(table), global_batch, replace=False) for _ in range(batches)])


def _order(profiled: np.ndarray, heavy: np.ndarray) -> np.ndarray:
    """[B] the profiled batches' ([K, B]) and the heavy batches' sizes sorted largest first,
    elementwise largest (:func:`.token_caps.count_floor`)."""
    return np.maximum((-np.sort(-profiled, axis=1)).max(axis=0), heavy)


def _enc_tokens(costs: SampleCosts, idx: np.ndarray) -> np.ndarray:
    if costs.encoder_tokens.size == 0:
        return np.zeros(idx.shape)
    return costs.encoder_tokens.sum(axis=1)[idx]


def _microbatch_counts(pp: int, per_replica: int) -> list[int]:
    """Microbatch counts searched for ``pp`` stages and ``per_replica`` samples per replica:
    pp, 2pp, 4pp, 8pp, and where the batch cannot fill all of those, also the most it can
    (one sample each), so a small global batch on a deep pipeline still gets a plan (fewer
    microbatches than stages is a valid 1F1B, with a larger bubble)."""
    ms = {pp, 2 * pp, 4 * pp, 8 * pp}
    if 1 <= per_replica < 8 * pp:
        ms.add(per_replica)
    return sorted(m for m in ms if m <= per_replica)


def _tp_split_error(model: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot shard some module's attention (None when it can shard all of them).

    tp applies to every stage, so it must split the heads of every encoder as well as the
    LLM's (Megatron shards each attention by heads); KV heads either split evenly or, fewer
    than tp, are replicated (tp a multiple of them)."""
    for mod in (*model.encoders, model.llm):
        if mod.heads % tp or (mod.kv_heads % tp and tp % mod.kv_heads):
            who = "the LLM" if mod is model.llm else f"encoder {mod.name!r}"
            return (
                f"tp={tp} does not split the {mod.heads} attention heads ({mod.kv_heads} KV "
                f"heads) of {who} evenly; choose a tp that divides them"
            )
    return None


def _long_samples(ctx: PlanContext, keys, tok: np.ndarray, dp: int, m: int, most: int = 3) -> str:
    """The samples that set a derived token cap, named where they do (longer than twice the
    cap the batches alone ask for at ``dp`` x ``m``): one very long text makes every
    microbatch's memory look like a model too big for the GPUs."""
    heavy = max(int(ctx.tokens_b.sum(axis=1).max()), ctx.heavy_batch)
    rest = cap_rule(heavy, 0, dp, m, count_floor(ctx.token_order, dp * m))
    long = np.flatnonzero(tok > 2 * rest)
    if not len(long):
        return ""
    top = long[np.argsort(-tok[long], kind="stable")][:most]
    named = ", ".join(f"{keys[i]} ({int(tok[i])} tokens)" for i in top)
    more = f" and {len(long) - most} more" if len(long) > most else ""
    return (
        f"; its token cap of {caps(ctx, dp, m)[0]} LLM tokens per microbatch is set by the "
        f"longest samples: {named}{more}; pin a smaller cap with max_tokens (it names the "
        "samples it cannot hold) or drop them from the index"
    )


def _candidates(
    ctx: PlanContext, units, dp, tp, pp, microbatches, schedule, shardings, recompute, costs
) -> tuple[list[Candidate], tuple[float, tuple[int, int]], tuple[int, int, int] | None]:
    """Every layout meeting the pins whose memory fits, with its analytic time; the least
    memory any layout needs and that layout's (dp, microbatches); (tokens, dp, microbatches)
    of the layout a pinned cap falls least short of, None when the cap ruled out none."""
    model, cluster, world = ctx.model, ctx.cluster, ctx.cluster.world_size
    gb = ctx.global_batch
    tps = [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= cluster.gpus_per_node and world % t == 0 and _tp_split_error(model, t) is None
    ]
    if tp is not None:
        if world % tp or tp > cluster.gpus_per_node:
            raise PlanError(
                f"tp={tp} must divide the {world} GPUs and fit in a node of "
                f"{cluster.gpus_per_node} GPUs"
            )
        why = _tp_split_error(model, tp)
        if why:
            raise PlanError(why)
        tps = [tp]
    if pp is not None and pp > len(units):
        raise PlanError(f"pp={pp} exceeds the model's {len(units)} layers")
    n_enc_layers = sum(x.layers for x in model.encoders)
    cands: list[Candidate] = []
    smallest_need, least_at = math.inf, (1, 1)
    cap_short: tuple[int, int, int] | None = None
    limit = MEMORY_HEADROOM * cluster.gpu_memory_gb
    stage_cache: dict[tuple[int, int], tuple[StagePlan, ...] | None] = {}
    params_cache: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for t in tps:
        pps = [p for p in _divisors(world // t) if p <= min(len(units), MAX_STAGES)]
        if pp is not None:
            pps = [pp] if (world // t) % pp == 0 else []
        for p in pps:
            d = world // (t * p)
            if (dp is not None and d != dp) or gb % d:
                continue
            ms = [microbatches] if microbatches is not None else _microbatch_counts(p, gb // d)
            ms = [mm for mm in ms if gb >= d * mm]
            for k in range(0, min(p - 1, n_enc_layers) + 1):
                if (p, k) not in stage_cache:
                    stage_cache[p, k] = stages_for(model, units, p, k)
                stages = stage_cache[p, k]
                if stages is None:
                    continue
                if (p, k) not in params_cache:
                    params_cache[p, k] = [stage_params(model, st) for st in stages]
                params = params_cache[p, k]
                for mm in ms:
                    cap, budget = caps(ctx, d, mm)
                    need = cap_need(ctx, d, mm) if ctx.max_tokens is not None else 0
                    if ctx.max_tokens is not None and cap < need:
                        # a pinned cap this layout's microbatches cannot serve: remember the
                        # least need, what the refusal quotes
                        cap_short = min(cap_short or (need, d, mm), (need, d, mm))
                        continue
                    enc_tokens = patch_cap(ctx, d, mm)  # what the memory model holds
                    mean_tokens = ctx.tokens_b.sum(axis=1).mean() / (d * mm)
                    for sh in shardings:
                        args = (model, stages, t, d, mm, cap, enc_tokens, budget)
                        mem = memory_gb(*args, False, params, schedule, sh)
                        rc = _recomputed(recompute, tuple(x > limit for x in mem))
                        if any(rc):
                            mem = memory_gb(*args, rc, params, schedule, sh)
                        if max(mem) < smallest_need:
                            smallest_need, least_at = max(mem), (d, mm)
                        if max(mem) > limit:
                            continue
                        at = _analytic(
                            stages, t, d, mm, cluster, model, mean_tokens, params, rc, sh, costs
                        )
                        cands.append(Candidate(t, p, d, mm, stages, mem, at, rc, k, sh))
    # equal times: the distributed optimizer (what plans assumed before), then less memory
    cands.sort(key=lambda c: (c.analytic_time, c.sharding != "optimizer", max(c.memory_gb)))
    return cands, (smallest_need, least_at), cap_short
