"""Pipeline simulator: iteration time of 1F1B or GPipe over per-microbatch stage times.

The planner scores layouts with it and the benchmarks report it, so it models
exactly the dependencies that make unbalanced microbatches expensive:

- forward of microbatch j on stage s waits for its forward on stage s - 1;
- backward of j on stage s waits for its backward on stage s + 1 (the last
  stage's backward waits for its own forward);
- each stage runs its operations in the schedule's fixed order (1F1B: S-1-s
  warm-up forwards, then one forward / one backward, then the cool-down).

Replicas share the op order, so the recurrence is evaluated once with arrays
over replicas. The iteration time is the slowest replica's (DP gradient sync).

Encoder stages take their forward load from the encoder sets E_j and their
backward load from the samples whose gradient arrives with the LLM set L_j: a
deferred sample's encoder backward runs with the microbatch that consumed it
(split backward), which is where its gradient becomes available.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from . import compiled
from .errors import InvalidInput

if TYPE_CHECKING:  # imported for type hints only: no cycle at run time
    from .assignment import Assignment
    from .cost_model import SampleCosts
    from .plan import StagePlan

__all__ = [
    "SCHEDULES",
    "PipelineResult",
    "simulate_pipeline",
    "schedule_order",
    "topological_order",
    "set_loads",
    "stage_times",
    "stage_sample_costs",
    "stage_shares",
    "times_from_sample_costs",
    "simulate_assignment",
    "ideal_times",
    "ideal_iteration_time",
    "lower_bound",
]

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of one simulated iteration."""

    iteration_time: float  # slowest replica
    replica_times: np.ndarray  # [R]
    stage_busy: np.ndarray  # [R, S] seconds of work per stage
    bubble_fraction: float  # idle share of the slowest replica's stages

    def to_dict(self) -> dict:
        """JSON-ready form of the simulated timings."""
        return {
            "iteration_time": self.iteration_time,
            "replica_times": self.replica_times.tolist(),
            "bubble_fraction": self.bubble_fraction,
        }


@lru_cache(maxsize=256)
def schedule_order(
    schedule: str, microbatches: int, stages: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, the ordered ops ``(kind, microbatch)`` with kind 0 = forward, 1 = backward."""
    if schedule not in SCHEDULES:
        raise InvalidInput(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    m, s_count = microbatches, stages
    out = []
    for s in range(s_count):
        if schedule == "gpipe":
            ops = [(0, j) for j in range(m)] + [(1, j) for j in range(m)]
        else:
            warm = min(s_count - 1 - s, m)
            ops = [(0, j) for j in range(warm)]
            f, b = warm, 0
            while f < m:
                ops.append((0, f))
                f += 1
                ops.append((1, b))
                b += 1
            ops.extend((1, j) for j in range(b, m))
        out.append(tuple(ops))
    return tuple(out)


def _check(fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.ndim != 3 or fwd.shape != bwd.shape:
        raise InvalidInput(f"fwd and bwd must both be [R, M, S]; got {fwd.shape} and {bwd.shape}")
    if min(fwd.shape) < 1:
        raise InvalidInput(
            f"fwd/bwd need at least one replica, microbatch and stage; got {fwd.shape}"
        )
    if (
        not (np.isfinite(fwd).all() and np.isfinite(bwd).all())
        or (fwd < 0).any()
        or (bwd < 0).any()
    ):
        raise InvalidInput("fwd/bwd times must be finite and >= 0")
    return fwd, bwd


@lru_cache(maxsize=256)
def topological_order(
    schedule: str, microbatches: int, stages: int
) -> tuple[tuple[int, int, int], ...]:
    """Every op ``(stage, kind, microbatch)`` in an order where its dependencies come first.

    Found once per shape by running the schedule's per-stage order to a fixed
    point, so the simulation itself is one pass with no readiness checks.
    """
    order = schedule_order(schedule, microbatches, stages)
    done_f = [[False] * microbatches for _ in range(stages)]
    done_b = [[False] * microbatches for _ in range(stages)]
    ptr = [0] * stages
    out: list[tuple[int, int, int]] = []
    while len(out) < 2 * microbatches * stages:
        progressed = False
        for s in range(stages):
            while ptr[s] < len(order[s]):
                kind, j = order[s][ptr[s]]
                if kind == 0:
                    if s > 0 and not done_f[s - 1][j]:
                        break
                    done_f[s][j] = True
                else:
                    if not (done_b[s + 1][j] if s + 1 < stages else done_f[s][j]):
                        break
                    done_b[s][j] = True
                out.append((s, kind, j))
                ptr[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedules above are deadlock-free
            raise RuntimeError(f"schedule {schedule!r} deadlocked at {ptr}")
    return tuple(out)


def simulate_pipeline(fwd: np.ndarray, bwd: np.ndarray, schedule: str = "1f1b") -> PipelineResult:
    """Simulate one iteration; ``fwd``/``bwd`` are [R, M, S] seconds.

    Every op starts when its stage is free and its dependency has ended; the
    recurrence runs once in a topological order with arrays over replicas (plain
    floats for a single replica, where numpy's per-call cost would dominate).
    """
    fwd, bwd = _check(fwd, bwd)
    r_count, m, s_count = fwd.shape
    topo = topological_order(schedule, m, s_count)
    if r_count > 1 and compiled.enabled():  # the same recurrence compiled, replica by replica
        from .assignment.search_kernel import recurrence  # numba is imported with it

        return _result(fwd, bwd, recurrence(fwd, bwd, np.asarray(topo, dtype=np.int64)))
    if r_count == 1:
        ft, bt = fwd[0].T.tolist(), bwd[0].T.tolist()  # [S][M]
        zero = 0.0
        maximum = max
    else:
        ft = list(np.ascontiguousarray(fwd.transpose(2, 1, 0)))  # [S] of [M, R]
        bt = list(np.ascontiguousarray(bwd.transpose(2, 1, 0)))
        zero = np.zeros(r_count)
        maximum = np.maximum
    f_end = [[zero] * m for _ in range(s_count)]
    b_end = [[zero] * m for _ in range(s_count)]
    free = [zero] * s_count
    last = s_count - 1
    for s, kind, j in topo:
        if kind == 0:
            start = maximum(free[s], f_end[s - 1][j]) if s else free[s]
            end = f_end[s][j] = start + ft[s][j]
        else:
            dep = b_end[s + 1][j] if s < last else f_end[s][j]
            end = b_end[s][j] = maximum(free[s], dep) + bt[s][j]
        free[s] = end
    free = np.asarray(free, dtype=np.float64).reshape(s_count, r_count)
    return _result(fwd, bwd, free.max(axis=0))


def _result(fwd: np.ndarray, bwd: np.ndarray, replica_times: np.ndarray) -> PipelineResult:
    busy = (fwd + bwd).sum(axis=1)  # [R, S]
    worst = int(np.argmax(replica_times))
    t = float(replica_times[worst])
    bubble = 1.0 - float(busy[worst].sum()) / (fwd.shape[2] * t) if t > 0 else 0.0
    return PipelineResult(t, replica_times, busy, bubble)


def set_loads(sets: Sequence[Sequence[np.ndarray]], per_sample: np.ndarray) -> np.ndarray:
    """Sum ``per_sample`` [N] or [N, K] over every set ``sets[r][j]``: [R, M] or [R, M, K].

    The sets are concatenated in slot order, so each slot's sum is a difference
    of two prefix sums (no scatter-add; empty sets give 0).
    """
    per_sample = np.asarray(per_sample, dtype=np.float64)
    r_count, m = len(sets), len(sets[0])
    flat = [s for row in sets for s in row]
    lens = np.array(list(map(len, flat)), dtype=np.int64)
    idx = np.concatenate(flat).astype(np.int64, copy=False) if flat else np.zeros(0, np.int64)
    ends = np.cumsum(lens)
    vals = per_sample[idx]
    prefix = np.zeros((len(idx) + 1,) + per_sample.shape[1:])
    np.cumsum(vals, axis=0, out=prefix[1:])
    sums = prefix[ends] - prefix[ends - lens]
    return sums.reshape((r_count, m) + per_sample.shape[1:])


def stage_sample_costs(
    costs: SampleCosts, stages: Sequence[StagePlan]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample (enc_fwd, enc_bwd, llm_fwd, llm_bwd) [N, S] of every stage's segments.

    Computed once per stage layout; :func:`times_from_sample_costs` then prices
    any assignment of any subset of the samples without touching the cost model.
    """
    n, s_count = len(costs), len(stages)
    ef, eb, lf, lb = (np.zeros((n, s_count)) for _ in range(4))
    for s, st in enumerate(stages):
        for seg in st.segments:
            f, b = costs.stage_cost(
                seg.encoder_index, seg.layer_start, seg.layer_end, seg.first, seg.last
            )
            if seg.encoder_index is None:
                lf[:, s] += f
                lb[:, s] += b
            else:
                ef[:, s] += f
                eb[:, s] += b
    return ef, eb, lf, lb


def stage_shares(
    costs: SampleCosts,
    stages: Sequence[StagePlan],
    groups: Sequence[Sequence[int]] | None = None,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """[S, G + 1] the share of each encoder group's work, then the LLM's, that every stage
    of ``stages`` holds: the stage layout as ``assign(stage_shares=)`` takes it.

    ``groups`` lists the encoders of each cost column (``ParallelPlan.cost_columns``, the
    columns the loader service balances); None: one column per encoder, what plans record. Work is forward plus
    backward (and the forward again on a stage that recomputes) summed over ``rows`` of
    ``costs`` (every sample where None): the planner's
    layer ranges follow the profiled load, and the embedding, the LM head and windowed
    attention layers weigh differently from a plain layer, so a layer count would misplace
    the cut. A module without work over those rows is shared by its layers.
    """
    groups = [[i] for i in range(costs.num_encoders)] if groups is None else groups
    column = {int(i): g for g, members in enumerate(groups) for i in members}
    k = len(groups) + 1
    work, layers = np.zeros((len(stages), k)), np.zeros((len(stages), k))
    for s, st in enumerate(stages):
        for seg in st.segments:
            if seg.encoder_index is not None and seg.encoder_index not in column:
                raise InvalidInput(
                    f"stage_shares: stage {s} holds encoder {seg.encoder_index}, which no "
                    f"group of {[list(g) for g in groups]} names"
                )
            c = k - 1 if seg.encoder_index is None else column[seg.encoder_index]
            f, b = costs.stage_cost(
                seg.encoder_index, seg.layer_start, seg.layer_end, seg.first, seg.last
            )
            t = f * (1 + st.recompute) + b  # a recomputing stage runs its forward twice
            work[s, c] += float(t.sum() if rows is None else t[rows].sum())
            layers[s, c] += seg.layer_end - seg.layer_start
    w = np.where(work.sum(axis=0) > 0, work, layers)
    total = w.sum(axis=0)
    if (total <= 0).any():
        k_bad = int(np.flatnonzero(total <= 0)[0])
        name = "the LLM" if k_bad == k - 1 else f"encoder column {k_bad}"
        raise InvalidInput(f"stage_shares: no stage holds a layer of {name}")
    return w / total


def times_from_sample_costs(
    assignment: Assignment,
    per_stage: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    rows: np.ndarray | None = None,
    tp_speedup: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """[R, M, S] forward and backward seconds from :func:`stage_sample_costs`.

    ``rows`` maps the assignment's sample indices to rows of ``per_stage`` (the
    global batch drawn from a larger table); None means the identity.
    """
    ef, eb, lf, lb = (x if rows is None else x[rows] for x in per_stage)
    s_count = ef.shape[1]
    enc_f = set_loads(assignment.encoder_sets, ef)
    llm = set_loads(assignment.llm_sets, np.concatenate([lf, lb, eb], axis=1))
    # encoder backward of a sample runs when its gradient arrives, i.e. with its L set
    fwd = enc_f + llm[..., :s_count]
    bwd = llm[..., s_count : 2 * s_count] + llm[..., 2 * s_count :]
    return fwd / tp_speedup, bwd / tp_speedup


def stage_times(
    assignment: Assignment, costs: SampleCosts, stages: Sequence[StagePlan], tp_speedup: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """[R, M, S] forward and backward seconds of every stage for ``assignment``.

    Encoder stages: forward from E_j, backward from the samples whose gradient
    arrives with L_j (split backward). LLM stages: both from L_j.
    ``tp_speedup`` divides every time (tensor parallelism across the stage's GPUs).
    """
    return times_from_sample_costs(
        assignment, stage_sample_costs(costs, stages), tp_speedup=tp_speedup
    )


def simulate_assignment(
    assignment: Assignment,
    costs: SampleCosts,
    stages: Sequence[StagePlan],
    schedule: str = "1f1b",
    tp_speedup: float = 1.0,
) -> PipelineResult:
    """Simulated iteration of ``assignment`` on the pipeline ``stages``."""
    fwd, bwd = stage_times(assignment, costs, stages, tp_speedup)
    return simulate_pipeline(fwd, bwd, schedule)


def ideal_times(fwd: np.ndarray, bwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every microbatch of every replica at the per-stage mean: the balanced ideal."""
    fwd, bwd = _check(fwd, bwd)
    mf = fwd.mean(axis=(0, 1), keepdims=True)
    mb = bwd.mean(axis=(0, 1), keepdims=True)
    return np.broadcast_to(mf, fwd.shape).copy(), np.broadcast_to(mb, bwd.shape).copy()


def ideal_iteration_time(fwd: np.ndarray, bwd: np.ndarray, schedule: str = "1f1b") -> float:
    """Iteration time with every microbatch at its stage's mean: what perfect balance would give."""
    mf, mb = ideal_times(fwd, bwd)
    return simulate_pipeline(mf[:1], mb[:1], schedule).iteration_time


def lower_bound(fwd: np.ndarray, bwd: np.ndarray) -> float:
    """No redistribution of this work over the replicas can beat it.

    The busiest stage of the slowest replica does at least the replicas' mean
    work on that stage, so ``max_s mean_r sum_j (f + b)[r, j, s]`` bounds every
    assignment of the same samples from below (pipeline fill and drain aside).
    """
    fwd, bwd = _check(fwd, bwd)
    return float((fwd + bwd).sum(axis=1).mean(axis=0).max())
