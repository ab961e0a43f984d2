"""Scoring the planner's candidate layouts: the context every layout is scored against, the
token caps of a (dp, microbatches) pair, and the simulation of the best few on the profiled
batches (:func:`simulate`), which :func:`~entrain_data.planner.make_plan` picks from."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .assignment import assign
from .cost_columns import column_shares, group_columns, share_columns
from .errors import InvalidInput, PlanError
from .plan import Cluster, StagePlan
from .plan_layout import stage_params
from .plan_time import (
    gather_times,
    group_bandwidth,
    stage_overheads,
    sync_time,
    tp_speedup,
)
from .presets import ModelSpec
from .simulator import (
    ideal_iteration_time,
    set_loads,
    simulate_pipeline,
    stage_sample_costs,
    stage_shares,
    times_from_sample_costs,
)
from .token_caps import cap_rule, count_floor, share_need, token_caps

__all__ = [
    "Candidate",
    "PlanContext",
    "caps",
    "patch_cap",
    "cap_need",
    "to_simulate",
    "simulate",
    "ideal",
]

SCREEN_BATCHES = 2  # profiled batches every simulated layout is scored on
SCREEN_MARGIN = 0.10  # slower than the best by more on those: not simulated on the rest


@dataclass(frozen=True)
class Candidate:
    """One feasible layout with its analytic and (when simulated) measured scores."""

    tp: int
    pp: int
    dp: int
    microbatches: int
    stages: tuple[StagePlan, ...]
    memory_gb: tuple[float, ...]
    analytic_time: float
    recompute: tuple[bool, ...] = ()  # per stage
    encoder_stages: int = 0  # pure encoder stages in front of the LLM's (0: encoders share one)
    sharding: str = "optimizer"


@dataclass(frozen=True)
class PlanContext:
    """What every candidate is scored against (fixed for one planning run)."""

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    tokens_b: np.ndarray  # [K, B] LLM tokens of the profiled batches
    largest_sample: int  # LLM tokens of the table's largest sample
    enc_tokens_b: np.ndarray  # [K, B] encoder tokens (all encoders)
    heavy_batch: int  # LLM tokens of the heaviest global batch of a few epochs of the table
    max_tokens: int | None = None  # the user's token cap, if pinned
    heavy_patches: int = 0  # encoder patches of the heaviest global batch, as heavy_batch
    largest_patches: int = 0  # encoder patches of the table's largest sample
    # [B] the heavy batches' LLM tokens and encoder patches sorted largest first (elementwise
    # largest over the batches): what the counting floor of the caps reads (count_floor)
    token_order: np.ndarray | None = None
    patch_order: np.ndarray | None = None


def caps(ctx: PlanContext, dp: int, m: int) -> tuple[int, int]:
    """Token cap and deferral budget of a microbatch for (dp, m) (see :mod:`.token_caps`)."""
    heavy = max(int(ctx.tokens_b.sum(axis=1).max()), ctx.heavy_batch)
    floor = count_floor(ctx.token_order, dp * m)
    return token_caps(heavy, ctx.largest_sample, dp, m, ctx.max_tokens, floor)


def patch_cap(ctx: PlanContext, dp: int, m: int) -> int:
    """Encoder patches per encoder set (0 without encoders): 1.5x the heaviest batch's mean
    set, at least the largest sample, enough that ``m`` sets hold a replica's share of the
    heaviest batch and at least the counting floor (the token cap's rule, :mod:`.token_caps`),
    so the cap never makes a batch of the index unassignable; the memory model holds this many
    patches per set."""
    if ctx.largest_patches <= 0:
        return 0
    heavy = max(int(ctx.enc_tokens_b.sum(axis=1).max()), ctx.heavy_patches)
    return cap_rule(heavy, ctx.largest_patches, dp, m, count_floor(ctx.patch_order, dp * m))


def cap_need(ctx: PlanContext, dp: int, m: int) -> int:
    """LLM tokens per microbatch that (dp, m) needs to serve every batch: a replica's share of
    the heaviest batch, and the strict counting floor (no set kept free: a pinned cap below it
    cannot serve the heaviest batch however its sets are cut, so it fits no such layout)."""
    heavy = max(int(ctx.tokens_b.sum(axis=1).max()), ctx.heavy_batch)
    strict = count_floor(ctx.token_order, dp * m, free=0.0)
    return max(share_need(heavy, ctx.largest_sample, dp, m), strict)


def to_simulate(cands: list[Candidate], top: int) -> list[Candidate]:
    """The analytically best few distinct layouts, the best one's next microbatch count, the worst.

    Distinct layouts (tp, pp, encoder stages) make the per-batch oracle a real
    alternative; the worst feasible layout prices a wrong static choice. The
    pick is made twice, over the distributed-optimizer candidates alone (what
    the planner simulated before other shardings existed, so adding them can
    only add layouts to the simulation) and over all of them.
    """
    chosen: list[Candidate] = []
    for pool in ([c for c in cands if c.sharding == "optimizer"], cands):
        if not pool:
            continue
        best_of: dict[tuple[int, int, int], Candidate] = {}
        for c in pool:
            best_of.setdefault((c.tp, c.pp, c.encoder_stages), c)
        layouts = list(best_of.values())[: max(1, top)]
        lead = layouts[0]
        siblings = [
            c
            for c in pool
            if (c.tp, c.pp, c.encoder_stages) == (lead.tp, lead.pp, lead.encoder_stages)
            and c is not lead
        ][:1]
        for c in layouts + siblings:
            if all(c is not x for x in chosen):
                chosen.append(c)
    if all(cands[-1] is not x for x in chosen):
        chosen.append(cands[-1])
    return chosen


def simulate(ctx: PlanContext, chosen, costs, idx, seed, schedule) -> tuple[list, np.ndarray, list]:
    """(layouts kept, [C, K] simulated iteration seconds of them on the profiled batches, means).

    A layout whose token cap cannot serve some profiled batch (the assignment
    refuses it: few samples per replica can outweigh the cap's allowance of one
    sample of imbalance) is infeasible and dropped; PlanError when none is left.

    Assignments depend on (dp, microbatches) and on the layout's cost columns and stage
    shares: entrain gets what the loader service will give it under that layout (the columns
    of :func:`~entrain_data.cost_columns.share_columns`, the plan's patch cap, the shares of
    :func:`~entrain_data.simulator.stage_shares`). Per-stage sample costs
    depend on the stage layout only. Both are computed once and shared by the layouts that
    have them in common. Every layout
    is first scored on ``SCREEN_BATCHES`` batches; one slower than the best by
    more than ``SCREEN_MARGIN`` there (far beyond the batch-to-batch spread of
    a global-batch sum) is not simulated further and stays NaN on the rest.
    """
    enc_cost, llm_cost = costs.encoder_cost(), costs.llm_cost()
    tok = costs.llm_tokens.astype(np.int64)
    enc_frozen = [e.frozen for e in ctx.model.encoders]  # forward only: no backward in L
    patches = costs.encoder_tokens.astype(np.int64)  # per encoder, summed as the costs are
    sims = np.full((len(chosen), len(idx)), np.nan)
    means_fb: list[list] = [[] for _ in chosen]  # per batch: (mean fwd [S], mean bwd [S], sync)
    assignments: dict[tuple, object] = {}
    per_stage: dict[int, tuple] = {}

    unservable: dict[int, str] = {}

    profiled = np.unique(idx)
    columns: dict[tuple, tuple] = {}

    def served(c: Candidate) -> tuple:
        """(encoder cost [N, G], patches [N, G], frozen per column, stage shares [S, G + 1],
        key) of a layout: what the loader service gives ``assign`` under it (the plan's cost
        columns, :func:`~entrain_data.cost_columns.share_columns`, and their shares of its
        stages with their recomputation, as the plan records them)."""
        ckey = (id(c.stages), tuple(c.recompute))
        if ckey not in columns:
            stages = tuple(
                replace(st, recompute=bool(rc))
                for st, rc in zip(c.stages, c.recompute or (False,) * len(c.stages))
            )
            per_encoder = stage_shares(costs, stages, rows=profiled)
            groups = share_columns(per_encoder, enc_frozen)
            sh = column_shares(per_encoder, groups)
            frozen = [all(enc_frozen[i] for i in g) for g in groups]
            key = (str(groups), sh.round(9).tobytes())
            cols = (group_columns(enc_cost, groups), group_columns(patches, groups))
            columns[ckey] = (*cols, frozen if any(frozen) else False, sh, key)
        return columns[ckey]

    def run(ci: int, k: int) -> None:
        c, b = chosen[ci], idx[k]
        enc, pts, frozen, sh, skey = served(c)
        akey = (c.dp, c.microbatches, skey, k)
        if akey not in assignments:
            cap, budget = caps(ctx, c.dp, c.microbatches)
            pcap = patch_cap(ctx, c.dp, c.microbatches)  # the plan's, as the service caps
            pt = {"encoder_patches": pts[b], "max_encoder_patches": pcap} if pcap else {}
            try:
                assignments[akey] = assign(
                    enc[b],
                    llm_cost[b],
                    tok[b],
                    dp=c.dp,
                    microbatches=c.microbatches,
                    max_tokens=cap,
                    defer_budget=budget,
                    method="entrain",
                    seed=seed,
                    iteration=k,
                    frozen_encoders=frozen,
                    stage_shares=sh,
                    **pt,
                )
            except InvalidInput as e:  # this (dp, M)'s cap cannot serve batch k
                assignments[akey] = e
        a = assignments[akey]
        if isinstance(a, InvalidInput) or ci in unservable:
            unservable.setdefault(ci, str(a))
            return
        if id(c.stages) not in per_stage:
            per_stage[id(c.stages)] = stage_sample_costs(costs, c.stages)
        params = [stage_params(ctx.model, st) for st in c.stages]
        sync = sync_time(params, c.tp, c.dp, ctx.cluster, c.sharding)
        f, bw = times_from_sample_costs(a, per_stage[id(c.stages)], b, tp_speedup(c.tp))
        bw = bw + f * np.asarray(c.recompute, dtype=float)
        gather = gather_times(params, c.tp, c.dp, ctx.cluster, c.sharding)
        f, bw = np.maximum(f, gather), np.maximum(bw, gather)
        mb_tokens = set_loads(a.llm_sets, tok[b]) if c.pp > 1 else None
        f, bw = _add_comm(f, bw, c, ctx, mb_tokens, stage_overheads(costs, c.stages, c.recompute))
        sims[ci, k] = simulate_pipeline(f, bw, schedule).iteration_time + sync
        means_fb[ci].append((f.mean(axis=(0, 1)), bw.mean(axis=(0, 1)), sync))

    screen = min(SCREEN_BATCHES, len(idx))
    for ci in range(len(chosen)):
        for k in range(screen):
            run(ci, k)
    first = np.where(sims[:, :screen] > 0, sims[:, :screen], np.inf).mean(axis=1)
    for ci in np.flatnonzero(first <= first.min() * (1 + SCREEN_MARGIN)):
        for k in range(screen, len(idx)):
            run(int(ci), k)
    keep = [ci for ci in range(len(chosen)) if ci not in unservable]
    if not keep:
        raise PlanError(
            "no simulated layout's LLM token cap serves every profiled batch: "
            + next(iter(unservable.values()))
        )
    return [chosen[ci] for ci in keep], sims[keep], [means_fb[ci] for ci in keep]


def ideal(per_batch: list, m: int, schedule: str) -> float:
    """Mean over the batches of the iteration with every microbatch at its stage's mean."""
    times = [
        ideal_iteration_time(
            np.broadcast_to(f, (1, m, len(f))), np.broadcast_to(b, (1, m, len(b))), schedule
        )
        + sync
        for f, b, sync in per_batch
    ]
    return float(np.mean(times))


def _add_comm(
    f, b, c: Candidate, ctx: PlanContext, mb_tokens: np.ndarray | None, overheads: tuple
) -> tuple:
    """Per-microbatch overhead (``overheads``: [S] forward and backward seconds,
    :func:`~entrain_data.plan_time.stage_overheads`) and activation transfer across stage
    boundaries."""
    f = f + overheads[0]
    b = b + overheads[1]
    if c.pp == 1:
        return f, b
    bw = group_bandwidth(ctx.cluster, c.tp * c.pp)
    t = mb_tokens * ctx.model.llm.hidden * 2 / bw
    f[..., :-1] += t[..., None]
    b[..., 1:] += t[..., None]
    return f, b
