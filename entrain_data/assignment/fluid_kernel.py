"""Compiled twin of :func:`.light_work.fluid_profile`'s descent (numba, when installed).

The descent prices ~140 probes a step (every microbatch's slope both ways, then 108 moves)
for 32 steps on 16 replicas: on the rows whose light work is laid (``multi-image-video``,
``text-heavy`` with the 1280-token cap at 8192 / dp 128) it was the largest part of an
assignment, a third of it numpy's per-call cost around the simulated runs. Here a step is
one loop; the probes run side by side (:func:`.search_kernel._run_lanes`), grouped by the
first op they change, latest first, so each group starts there: the ops before it end as
the step's current shares' run does (every lane starts the step holding that run, and a
group writes only ops from its own start on, which no later group, starting earlier, reads
from the lanes). Within a CV bound (the light work's bounded profile) a move that leaves
it is not run: its CVs come from the same moments as :func:`.light_work._fluid_cv`'s, summed
in the same order (compiled, that profile took ``llava-fixed``/vl-1b at 8192 / dp 128 on 4
stages from 18 to 8 ms of the light work's fluid profiles). Results are identical to the
numpy path: every probe is built and run with the same products, sums and maxima, the moves
are drawn in the same order (stable ties) and the first of equal times wins, as numpy's
argmin. ``tests/test_compiled.py`` compares the two.
"""

from __future__ import annotations

import numpy as np

from ..compiled import jit
from .search_kernel import _first_ops, _lanes, _run_changes, _run_lanes

__all__ = ["fluid_descent"]


@jit(inline=True)
def _fill_probe(times, c, fh, bh, fl, bl, share):
    """Lane ``c`` of ``times``: the loads ``fh + share * fl`` forward, ``bh + share * bl``
    backward ([M, S] and [S]; ``share`` [M])."""
    m, s_count = fh.shape
    for j in range(m):
        a = share[j]
        for s in range(s_count):
            times[j * s_count + s, c] = fh[j, s] + a * fl[s]
            times[(m + j) * s_count + s, c] = bh[j, s] + a * bl[s]


@jit
def fluid_descent(fh, bh, fl, bl, upper, share, goal, topo, steps, pairs, tries, min_step, step0,
                  hc, hh, hm, lk, limit):  # fmt: skip
    """[R] times; ``share`` [R, M] updated in place: :func:`.light_work.fluid_profile`'s
    descent (``steps``, ``pairs``, ``tries`` its ``_STEPS``, ``_PAIRS``, ``_TRIES``; a
    replica stops once its slope step, from ``step0``, falls below ``min_step``, or once its
    time is at most ``goal`` [R]). A probe changes one or two microbatches' shares (``moved``
    [P, 2], -1 for none; ``value`` [P, 2] their new shares): the others' loads are the
    current shares' (numpy's ``a + 0`` and ``max(a, 0)`` of a share >= 0 give the same
    loads). Within a CV bound where ``limit`` [R, K] has columns (K > 0): a move whose
    share leaves it (:func:`_within_bound`, on ``hc`` [R, M, K] the heavy loads centred,
    ``hh`` [R, K] their mean square, ``hm`` [R, K] their mean, ``lk`` [R, K] the light work's
    totals) is not run, as the numpy path does not read its time."""
    r_count, m, s_count = fh.shape
    prev, dep, load, last, times, ends, lane_t, held = _lanes(topo, m, s_count)
    first = _first_ops(topo, m)
    k = min(pairs, m)
    n_probes = 2 * m + k * k * tries.shape[0]  # the slope probes, then the moves
    moved = np.full((n_probes, 2), -1, np.int64)
    value = np.zeros((n_probes, 2))
    starts = np.empty(n_probes, np.int64)  # the first op each changes
    got = np.empty(n_probes)
    base = np.empty((2, m, s_count))  # the current shares' loads
    loads = np.empty((n_probes, 2, 2, s_count))  # each probe's changed microbatches' loads
    add_order, take_order = np.empty(m, np.int64), np.empty(m, np.int64)
    cost = np.empty(m)
    probe = np.empty(m)  # a move's shares, for its CVs
    cur = np.empty(r_count)
    for r in range(r_count):
        a = share[r].copy()
        _fill_probe(times, 0, fh[r], bh[r], fl[r], bl[r], a)
        _run_lanes(prev, dep, load, last, times, ends, 1, lane_t, 0)
        cur[r] = lane_t[0]
        step = step0
        for _ in range(steps):
            if not (step >= min_step and cur[r] > goal[r]):
                break
            for j in range(m):  # every microbatch's slope: a small share added, removed
                moved[j, 0] = moved[m + j, 0] = j
                value[j, 0] = a[j] + step
                value[m + j, 0] = a[j] - min(step, a[j])
                starts[j] = starts[m + j] = first[j]
            _run_probes(prev, dep, load, last, times, ends, lane_t, held, fh[r], bh[r],
                        fl[r], bl[r], a, moved, value, starts, base, loads, 0, 2 * m, got)  # fmt: skip
            for j in range(m):
                cost[j] = got[j] if upper[r, j] - a[j] > 1e-12 else np.inf
            _smallest(cost, k, add_order)
            for j in range(m):
                cost[j] = got[m + j] if a[j] > 1e-12 else np.inf
            _smallest(cost, k, take_order)
            q = 2 * m
            for p in range(k * k):  # from each of the k best sources to each of the k best
                src, dst = take_order[p // k], add_order[p % k]
                most = min(a[src], upper[r, dst] - a[dst])
                most = 0.0 if src == dst else max(most, 0.0)
                for t in range(tries.shape[0]):
                    amount = most * tries[t]
                    # numpy's order: taken from the source, then added to the sink
                    if src == dst:
                        moved[q, 0], moved[q, 1] = src, -1
                        value[q, 0] = max(a[src] - amount + amount, 0.0)
                    else:
                        moved[q, 0], moved[q, 1] = src, dst
                        value[q, 0] = max(a[src] - amount, 0.0)
                        value[q, 1] = max(a[dst] + amount, 0.0)
                    starts[q] = min(first[src], first[dst])
                    if limit.shape[1] == 0 or _within_bound(
                        a, moved[q], value[q], hc[r], hh[r], hm[r], lk[r], limit[r], probe
                    ):
                        q += 1  # kept in order: the first of equal times still wins
            if q > 2 * m:
                _run_probes(prev, dep, load, last, times, ends, lane_t, held, fh[r], bh[r],
                            fl[r], bl[r], a, moved, value, starts, base, loads, 2 * m, q, got)  # fmt: skip
            best = 2 * m
            for p in range(2 * m + 1, q):
                if got[p] < got[best]:
                    best = p
            if q > 2 * m and got[best] < cur[r] * (1 - 1e-9):
                for h in range(2):
                    if moved[best, h] >= 0:
                        a[moved[best, h]] = value[best, h]
                cur[r] = got[best]
            else:
                step = step / 2
        share[r] = a
    return cur


@jit(inline=True)
def _run_probes(prev, dep, load, last, times, ends, lane_t, held, fh, bh, fl, bl, a, moved,
                value, starts, base, loads, lo, hi, got):  # fmt: skip
    """``got[lo:hi]``: the times of probes ``lo`` to ``hi`` of one replica (``moved``,
    ``value``: see :func:`fluid_descent`), each the current shares' loads (``base`` [2, M,
    S], built here from ``a``) with its microbatches' loads (``loads`` [P, 2, 2, S], built
    here) in their place (:func:`.search_kernel._run_changes`)."""
    for j in range(a.shape[0]):
        _loads_at(fh, bh, fl, bl, j, a[j], base[:, j])
    for p in range(lo, hi):
        for h in range(2):
            if moved[p, h] >= 0:
                _loads_at(fh, bh, fl, bl, moved[p, h], value[p, h], loads[p, h])
    _run_changes(prev, dep, load, last, times, ends, lane_t, held, base, moved[lo:hi],
                 loads[lo:hi], starts[lo:hi], got[lo:hi])  # fmt: skip


@jit(inline=True)
def _loads_at(fh, bh, fl, bl, j, share, out):
    """``out`` [2, S]: microbatch ``j``'s forward and backward loads at ``share`` of the
    light work (the products and sums of :func:`_fill_probe`)."""
    for s in range(fh.shape[1]):
        out[0, s] = fh[j, s] + share * fl[s]
        out[1, s] = bh[j, s] + share * bl[s]


@jit
def _smallest(values, k, out):
    """``out[:k]``: the indices of the ``k`` smallest ``values``, ties by index (a stable
    argsort's first ``k``)."""
    taken = np.zeros(values.shape[0], np.bool_)
    for i in range(k):
        best = -1
        for j in range(values.shape[0]):
            if not taken[j] and (best < 0 or values[j] < values[best]):
                best = j
        taken[best] = True
        out[i] = best


@jit(inline=True)
def _within_bound(a, moved, value, hc, hh, hm, lk, limit, probe):
    """Whether the shares ``a`` [M] with ``moved`` [2] (-1: none) set to ``value`` [2] keep
    every module's fluid CV within ``limit`` [K]: :func:`.light_work._fluid_cv`'s moments,
    with its products and sums in its order (``probe`` [M]: scratch)."""
    m = a.shape[0]
    for j in range(m):
        probe[j] = a[j]
    for h in range(2):
        if moved[h] >= 0:
            probe[moved[h]] = value[h]
    s1 = probe[0]
    for j in range(1, m):
        s1 = s1 + probe[j]
    s1 = s1 / m
    ss = (probe[0] - s1) * (probe[0] - s1)
    for j in range(1, m):
        ss = ss + (probe[j] - s1) * (probe[j] - s1)
    ss = ss / m
    for k in range(limit.shape[0]):
        cov = (probe[0] - s1) * hc[0, k]
        for j in range(1, m):
            cov = cov + (probe[j] - s1) * hc[j, k]
        var = hh[k] + 2.0 * lk[k] * (cov / m) + lk[k] * lk[k] * ss
        mean = hm[k] + lk[k] * s1
        std = np.sqrt(max(var, 0.0))
        cv = std / mean if mean > 0 else 0.0
        if not cv <= limit[k] + 1e-12:
            return False
    return True
