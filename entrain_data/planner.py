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

Model of time and memory (stated so it can be checked and calibrated):

- stage compute: the cost model's seconds / (tp * 0.9 ** log2(tp)), i.e. 10 %
  lost to tensor-parallel communication per doubling;
- point-to-point: each microbatch's activations (tokens x hidden x 2 bytes)
  cross every stage boundary forward and backward at NVLink speed inside a
  node, at network speed across nodes;
- DP gradient all-reduce of the largest stage's bf16 gradients, not overlapped;
- memory per GPU: bf16 weights + fp32 gradients + fp32 Adam state and master
  weights sharded over dp (distributed optimizer: 6 + 12/dp bytes/param;
  frozen weights 2 bytes), plus activations of the microbatches 1F1B keeps in
  flight on the stage (S - s of them) at the token cap (34 * hidden / tp bytes
  per token per layer, Korthikanti et al. 2022 with flash attention), plus the
  deferral buffer on the stage that receives encoder outputs. A layout that does
  not fit may use full activation recomputation (only layer inputs kept; the
  backward repeats the forward), chosen only where it is needed.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from .assignment import assign
from .cost_model import SampleCosts, per_sample_costs
from .errors import InvalidInput, PlanError
from .metadata import SampleTable
from .plan import Cluster, ParallelPlan, StagePlan, StageSegment
from .presets import ModelSpec
from .simulator import simulate_pipeline, stage_times

__all__ = ["make_plan", "Candidate", "TP_EFFICIENCY", "MEMORY_HEADROOM"]

log = logging.getLogger(__name__)

TP_EFFICIENCY = 0.9  # compute efficiency kept per doubling of tensor parallelism
MEMORY_HEADROOM = 0.9  # share of GPU memory the plan may use
ACT_BYTES_PER_TOKEN_LAYER = 34.0  # x hidden / tp
RECOMPUTE_SLOWDOWN = 4.0 / 3.0  # full recomputation repeats the forward (f + 2f -> 2f + 2f)
OVERHEAD_PER_MICROBATCH = 2e-4  # seconds of launch/scheduling per stage per microbatch


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
    recompute: bool = False


def _tp_speedup(tp: int) -> float:
    return tp * TP_EFFICIENCY ** math.log2(tp)


def _units(model: ModelSpec, costs: SampleCosts, batches: np.ndarray):
    """The model as a chain of layer units: (encoder index or None, layer, mean cost per batch)."""
    out = []
    for e, enc in enumerate(model.encoders):
        for layer in range(enc.layers):
            f, b = costs.stage_cost(e, layer, layer + 1, layer == 0, layer == enc.layers - 1)
            out.append((e, layer, float((f + b)[batches].sum(axis=1).mean())))
    n = model.llm.layers
    for layer in range(n):
        f, b = costs.stage_cost(None, layer, layer + 1, layer == 0, layer == n - 1)
        out.append((None, layer, float((f + b)[batches].sum(axis=1).mean())))
    return out


def _split(costs: list[float], k: int) -> list[int] | None:
    """Cut a chain into ``k`` non-empty contiguous groups minimising the largest sum (boundaries)."""
    n = len(costs)
    if k > n or k < 1:
        return None
    c = np.asarray(costs)
    prefix = np.concatenate([[0.0], np.cumsum(c)])

    def cuts_for(limit: float) -> list[int] | None:
        cuts, start = [], 0
        while start < n:
            end = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
            end = max(end, start + 1)
            cuts.append(end)
            start = end
        return cuts if len(cuts) <= k else None

    lo, hi = float(c.max()), float(c.sum())
    for _ in range(50):
        mid = (lo + hi) / 2
        if cuts_for(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = cuts_for(hi * (1 + 1e-9)) or [n]
    while len(cuts) < k:  # split the largest group that has more than one unit
        bounds = [0] + cuts
        sizes = [(prefix[b] - prefix[a], a, b) for a, b in zip(bounds, bounds[1:]) if b - a > 1]
        _, a, b = max(sizes)
        mid = a + (b - a) // 2
        cuts = sorted(cuts + [mid])
    return cuts


def _stages_for(model: ModelSpec, units, pp: int, enc_stages: int) -> tuple[StagePlan, ...] | None:
    """Stages with ``enc_stages`` pure encoder stages (0: encoders share the first LLM stage)."""
    n_enc = sum(m.layers for m in model.encoders)
    enc_units, llm_units = units[:n_enc], units[n_enc:]
    groups: list[list[tuple]] = []
    if enc_stages:
        cuts = _split([u[2] for u in enc_units], enc_stages)
        if cuts is None:
            return None
        start = 0
        for c in cuts:
            groups.append(enc_units[start:c])
            start = c
        llm_cuts = _split([u[2] for u in llm_units], pp - enc_stages)
        if llm_cuts is None:
            return None
        start = 0
        for c in llm_cuts:
            groups.append(llm_units[start:c])
            start = c
    else:
        # encoders ride on the first stage: treat them as weight in front of the LLM chain
        head = sum(u[2] for u in enc_units)
        costs = [u[2] for u in llm_units]
        costs[0] += head
        llm_cuts = _split(costs, pp)
        if llm_cuts is None:
            return None
        start = 0
        for i, c in enumerate(llm_cuts):
            groups.append((enc_units if i == 0 else []) + llm_units[start:c])
            start = c
    stages = []
    for s, g in enumerate(groups):
        segs = []
        for key in dict.fromkeys(u[0] if u[0] is not None else -1 for u in g):
            e = None if key == -1 else key
            layers = [u[1] for u in g if (u[0] if u[0] is not None else -1) == key]
            mod = model.llm if e is None else model.encoders[e]
            name = "llm" if e is None else mod.name
            a, b = min(layers), max(layers) + 1
            segs.append(StageSegment(name, e, a, b, a == 0, b == mod.layers))
        stages.append(StagePlan(s, tuple(segs), float(sum(u[2] for u in g))))
    return tuple(stages)


def _stage_params(model: ModelSpec, st: StagePlan) -> tuple[float, float]:
    """(trainable, frozen) parameters held by a stage."""
    train = frozen = 0.0
    for seg in st.segments:
        mod = model.llm if seg.encoder_index is None else model.encoders[seg.encoder_index]
        p = (seg.layer_end - seg.layer_start) * mod.layer_parameters()
        if seg.first:
            p += mod.embed_parameters()
        if seg.last:
            p += mod.head_parameters(model.llm.hidden)
        if mod.frozen:
            frozen += p
        else:
            train += p
    return train, frozen


def _memory_gb(
    model, stages, tp, dp, m, max_tokens, enc_tokens, defer_budget, recompute=False
) -> tuple[float, ...]:
    pp = len(stages)
    out = []
    receives_encoder_output = next(
        (i for i, st in enumerate(stages) if any(s.encoder_index is None for s in st.segments)), 0
    )
    for s, st in enumerate(stages):
        train, frozen = _stage_params(model, st)
        weights = (train * (6 + 12 / dp) + frozen * 2) / tp
        inflight = min(m, pp - s)
        act = 0.0
        peak_layer = 0.0  # full recomputation: one layer's activations live at a time
        for seg in st.segments:
            mod = model.llm if seg.encoder_index is None else model.encoders[seg.encoder_index]
            toks = max_tokens if seg.encoder_index is None else enc_tokens
            layer = toks * ACT_BYTES_PER_TOKEN_LAYER * mod.hidden / tp
            n_layers = seg.layer_end - seg.layer_start
            if recompute:  # only each layer's input (bf16) is kept
                act += n_layers * toks * 2 * mod.hidden
                peak_layer = max(peak_layer, layer)
            else:
                act += n_layers * layer
        total = weights + act * inflight + peak_layer
        if s == receives_encoder_output:
            total += defer_budget * model.llm.hidden * 2
        out.append(total / 2**30)
    return tuple(out)


def _caps(tokens_b: np.ndarray, dp: int, m: int) -> tuple[int, int]:
    """Token cap and deferral budget for (dp, m) from the profiled batches' token counts."""
    per_mb = tokens_b.sum(axis=1).max() / (dp * m)
    largest = int(tokens_b.max())
    cap = max(largest, int(math.ceil(1.5 * per_mb)))
    cap = int(math.ceil(cap / 256) * 256)
    return cap, int(math.ceil(2 * per_mb))


def _analytic(stages, tp, dp, m, cluster, model, mean_tokens_mb) -> float:
    loads = np.array([st.expected_load for st in stages]) / (dp * m) / _tp_speedup(tp)
    pp = len(stages)
    bw_p2p = (
        cluster.intra_node_gbps if tp * pp <= cluster.gpus_per_node else cluster.inter_node_gbps
    ) * 1e9
    p2p = 2 * mean_tokens_mb * model.llm.hidden * 2 / bw_p2p if pp > 1 else 0.0
    per_mb = loads.max() + p2p + OVERHEAD_PER_MICROBATCH
    return (m + pp - 1) * per_mb + _sync_time(stages, tp, dp, cluster, model)


def _sync_time(stages, tp: int, dp: int, cluster: Cluster, model: ModelSpec) -> float:
    """DP all-reduce of the largest stage's bf16 gradients (ring: 2 (dp-1)/dp of the bytes)."""
    if dp == 1:
        return 0.0
    grads = max(_stage_params(model, st)[0] for st in stages) * 2 / tp
    bw = (
        cluster.intra_node_gbps if tp * dp <= cluster.gpus_per_node else cluster.inter_node_gbps
    ) * 1e9
    return 2 * (dp - 1) / dp * grads / bw


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_plan(
    table: SampleTable,
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    microbatches: int | None = None,
    batches: int = 8,
    seed: int = 0,
    schedule: str = "1f1b",
    simulate_top: int = 6,
    calibration: dict | None = None,
    costs: SampleCosts | None = None,
) -> ParallelPlan:
    """Search the feasible layouts for ``model`` on ``cluster`` and return the static plan."""
    t0 = time.perf_counter()
    if not isinstance(global_batch, int) or global_batch < 1:
        raise InvalidInput(f"global_batch must be a positive integer, got {global_batch!r}")
    if global_batch > len(table):
        raise InvalidInput(
            f"global_batch {global_batch} exceeds the {len(table)} samples of {table.origin}"
        )
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("microbatches", microbatches)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise InvalidInput(f"{name} must be a positive integer, got {v!r}")
    costs = costs if costs is not None else per_sample_costs(table, model, calibration=calibration)
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(len(table), global_batch, replace=False) for _ in range(batches)])
    enc_cost = costs.encoder_cost()
    llm_cost = costs.llm_cost()
    tok = costs.llm_tokens.astype(np.int64)
    tokens_b = tok[idx]
    enc_tok_b = (
        costs.encoder_tokens.sum(axis=1)[idx]
        if costs.encoder_tokens.size
        else np.zeros_like(tokens_b)
    )
    units = _units(model, costs, idx)
    n_units = len(units)
    world = cluster.world_size

    tps = [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= cluster.gpus_per_node and world % t == 0 and model.llm.heads % t == 0
    ]
    if tp is not None:
        if tp not in tps and not (world % tp == 0 and tp <= cluster.gpus_per_node):
            raise PlanError(
                f"tp={tp} does not divide the {world} GPUs or exceeds {cluster.gpus_per_node} GPUs per node"
            )
        tps = [tp]
    cands: list[Candidate] = []
    smallest_need = math.inf
    stage_cache: dict[tuple[int, int], tuple[StagePlan, ...] | None] = {}
    for t in tps:
        pps = [p for p in _divisors(world // t) if p <= min(n_units, 32)]
        if pp is not None:
            pps = [pp] if (world // t) % pp == 0 and pp <= n_units else []
        for p in pps:
            d = world // (t * p)
            if dp is not None and d != dp:
                continue
            if global_batch < d:
                continue
            ms = (
                [microbatches]
                if microbatches is not None
                else sorted({mm for mm in (p, 2 * p, 4 * p, 8 * p, 16, 32) if mm >= 1})
            )
            ms = [mm for mm in ms if global_batch >= d * mm]
            n_enc_layers = sum(x.layers for x in model.encoders)
            for k in range(0, min(p - 1, n_enc_layers) + 1):
                key = (p, k)
                if key not in stage_cache:
                    stage_cache[key] = _stages_for(model, units, p, k)
                stages = stage_cache[key]
                if stages is None:
                    continue
                for mm in ms:
                    cap, budget = _caps(tokens_b, d, mm)
                    enc_tokens = int(math.ceil(1.5 * enc_tok_b.sum(axis=1).max() / (d * mm)))
                    enc_tokens = max(enc_tokens, int(enc_tok_b.max()))
                    for rc in (False, True):  # recompute only when the layout needs it
                        mem = _memory_gb(model, stages, t, d, mm, cap, enc_tokens, budget, rc)
                        need = max(mem)
                        smallest_need = min(smallest_need, need)
                        if need <= MEMORY_HEADROOM * cluster.gpu_memory_gb:
                            break
                    else:
                        continue
                    at = _analytic(
                        stages, t, d, mm, cluster, model, tokens_b.sum(axis=1).mean() / (d * mm)
                    ) * (RECOMPUTE_SLOWDOWN if rc else 1.0)
                    cands.append(Candidate(t, p, d, mm, stages, mem, at, rc))
    if not cands:
        if smallest_need is math.inf:
            raise PlanError(
                f"no layout of {world} GPUs fits the constraints (dp={dp}, tp={tp}, pp={pp}, "
                f"microbatches={microbatches}, global batch {global_batch})"
            )
        raise PlanError(
            f"model {model.name or model.llm.name!r} fits no layout of {world} GPUs: the smallest "
            f"needs {smallest_need:.1f} GB per GPU, {MEMORY_HEADROOM * cluster.gpu_memory_gb:.1f} GB usable "
            f"of {cluster.gpu_memory_gb:g} GB"
        )
    cands.sort(key=lambda c: c.analytic_time)
    chosen = cands[:simulate_top] + ([cands[-1]] if len(cands) > simulate_top else [])
    sims = np.zeros((len(chosen), batches))
    ideals = np.zeros(len(chosen))
    assign_cache: dict[tuple[int, int], list] = {}
    for ci, c in enumerate(chosen):
        cap, budget = _caps(tokens_b, c.dp, c.microbatches)
        akey = (c.dp, c.microbatches)
        if akey not in assign_cache:
            assign_cache[akey] = [
                assign(
                    enc_cost[b],
                    llm_cost[b],
                    tok[b],
                    dp=c.dp,
                    microbatches=c.microbatches,
                    max_tokens=cap,
                    defer_budget=budget,
                    method="entrain",
                    seed=seed,
                    iteration=k,
                )
                for k, b in enumerate(idx)
            ]
        ideal_acc = 0.0
        for k, b in enumerate(idx):
            sub = _subset_costs(costs, b)
            f, bw = stage_times(assign_cache[akey][k], sub, c.stages, _tp_speedup(c.tp))
            if c.recompute:
                bw = bw + f
            f, bw = _add_comm(f, bw, c, cluster, model, tok[b], assign_cache[akey][k])
            sync = _sync_time(c.stages, c.tp, c.dp, cluster, model)
            sims[ci, k] = simulate_pipeline(f, bw, schedule).iteration_time + sync
            mf = np.broadcast_to(f.mean(axis=(0, 1), keepdims=True), f.shape)
            mb = np.broadcast_to(bw.mean(axis=(0, 1), keepdims=True), bw.shape)
            ideal_acc += simulate_pipeline(mf, mb, schedule).iteration_time + sync
        ideals[ci] = ideal_acc / batches
    means = sims.mean(axis=1)
    best = int(np.argmin(means))
    oracle = sims.min(axis=0).mean()
    worst = int(np.argmax(means))
    c = chosen[best]
    cap, budget = _caps(tokens_b, c.dp, c.microbatches)
    elapsed = time.perf_counter() - t0
    log.info("planned %d candidates (%d simulated) in %.2fs", len(cands), len(chosen), elapsed)
    return ParallelPlan(
        world_size=world,
        gpus_per_node=cluster.gpus_per_node,
        dp=c.dp,
        tp=c.tp,
        pp=c.pp,
        stages=tuple(
            StagePlan(
                s.index, s.segments, s.expected_load / (c.dp * c.microbatches) / _tp_speedup(c.tp)
            )
            for s in c.stages
        ),
        microbatches=c.microbatches,
        global_batch=global_batch,
        max_tokens=cap,
        defer_budget=budget,
        schedule=schedule,
        expected_iteration_time=float(means[best]),
        ideal_iteration_time=float(ideals[best]),
        oracle_gap=float(means[best] / oracle - 1.0),
        worst_static_gap=float(1.0 - means[best] / means[worst]),
        memory_gb=c.memory_gb,
        recompute=c.recompute,
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
            "simulated": [
                {
                    "tp": x.tp,
                    "pp": x.pp,
                    "dp": x.dp,
                    "microbatches": x.microbatches,
                    "stages": [s.module for s in x.stages],
                    "mean_time": float(mt),
                }
                for x, mt in zip(chosen, means)
            ],
        },
    )


def _subset_costs(costs: SampleCosts, rows: np.ndarray) -> SampleCosts:
    """The costs of ``rows`` only (a view for one global batch)."""
    from dataclasses import fields, replace

    kw = {}
    n = len(costs)
    for f in fields(costs):
        v = getattr(costs, f.name)
        if (
            isinstance(v, np.ndarray)
            and v.ndim >= 1
            and len(v) == n
            and f.name not in ("encoder_bwd_factor", "encoder_call_overhead")
        ):
            kw[f.name] = v[rows]
    return replace(costs, **kw)


def _add_comm(f, b, c: Candidate, cluster: Cluster, model: ModelSpec, tok: np.ndarray, a) -> tuple:
    """Per-microbatch overhead and activation transfer across stage boundaries."""
    f = f + OVERHEAD_PER_MICROBATCH
    b = b + OVERHEAD_PER_MICROBATCH
    if c.pp == 1:
        return f, b
    bw = (
        cluster.intra_node_gbps if c.tp * c.pp <= cluster.gpus_per_node else cluster.inter_node_gbps
    ) * 1e9
    mb_tokens = np.array([[tok[s].sum() for s in row] for row in a.llm_sets], dtype=np.float64)
    t = mb_tokens * model.llm.hidden * 2 / bw
    f = f.copy()
    b = b.copy()
    f[..., :-1] += t[..., None]
    b[..., 1:] += t[..., None]
    return f, b
