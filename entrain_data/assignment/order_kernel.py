"""Compiled twin of :func:`.slot_order.order_slowest`'s swap rounds (numba, when installed).

numpy prices a round's ``m (m - 1) / 2`` swaps of every searched replica as [A, P, m, S]
gathers: about 40 ms an assignment at 8192 / dp 128, most of it numpy's per-call cost.
Here each swap is one loop, and the swaps that keep every E set before its L set and the
buffer within its budget run side by side (:func:`.search_kernel._run_lanes`), from the
first op of the earlier slot they exchange: the lanes hold the current order's loads and
run, and each swap writes its two slots and puts them back
(:func:`.search_kernel._run_changes`, as :mod:`.fluid_kernel`'s probes; 2% off an assignment at 8192 / dp 128). Results are identical to the numpy path:
every time comes from the same max/+ sequence, the buffer's running sum adds in the same
order, and ties go to the first swap in ``numpy.triu_indices`` order.
``tests/test_compiled.py`` compares the two.
"""

from __future__ import annotations

import numpy as np

from ..compiled import jit
from .search_kernel import _first_ops, _lanes, _run_changes

__all__ = ["swap_rounds"]


@jit
def swap_rounds(
    fwd, bwd, e_enc, l_enc, enc, flow_in, flow_out, budget, use_budget, t_now, rounds, topo
):
    """[A, m] new slot of every old slot, after at most ``rounds`` best swaps per replica
    (``fwd``, ``bwd`` [A, m, S] loads by old slot; ``e_enc``, ``l_enc`` [A, n] the E and L
    slots of the samples ``enc`` [A, n] marks; ``flow_in``, ``flow_out`` [A, m] the tokens
    entering and leaving the buffer at each old slot; ``t_now`` [A] the current times)."""
    a_count, m, s_count = fwd.shape
    n = e_enc.shape[1]
    prev, dep, load, last, lanes, ends, lane_t, held = _lanes(topo, m, s_count)
    perm = np.empty((a_count, m), np.int64)
    times = np.empty((2, m, s_count))
    inv = np.empty(m, np.int64)
    feeds = np.zeros((m, m), np.bool_)
    first = _first_ops(topo, m)
    pairs = np.empty((m * (m - 1) // 2, 2), np.int64)
    loads = np.empty((m * (m - 1) // 2, 2, 2, s_count))
    starts = np.empty(m * (m - 1) // 2, np.int64)
    got = np.empty(m * (m - 1) // 2)
    for r in range(a_count):
        for x in range(m):
            perm[r, x] = x
        t_cur = t_now[r]
        for _ in range(rounds):
            for x in range(m):  # the current order's loads
                inv[perm[r, x]] = x
            for y in range(m):
                times[0, y] = fwd[r, inv[y]]
                times[1, y] = bwd[r, inv[y]]
            feeds[:, :] = False  # feeds[x, y]: a sample encoded at slot x waits for slot y
            for i in range(n):
                if enc[r, i]:
                    feeds[perm[r, e_enc[r, i]], perm[r, l_enc[r, i]]] = True
            count = 0  # the allowed swaps: their slots, those slots' loads, first op changed
            for a in range(m):
                for b in range(a + 1, m):
                    if _allowed(a, b, feeds, inv, flow_in[r], flow_out[r], budget, use_budget):
                        pairs[count, 0], pairs[count, 1] = a, b
                        loads[count, 0], loads[count, 1] = times[:, b], times[:, a]
                        starts[count] = min(first[a], first[b])
                        count += 1
            _run_changes(prev, dep, load, last, lanes, ends, lane_t, held, times,
                         pairs[:count], loads[:count], starts[:count], got)  # fmt: skip
            best_t, best_a, best_b = np.inf, -1, -1
            for i in range(count):  # the first of equal times, in triu order
                if got[i] < best_t:
                    best_t, best_a, best_b = got[i], pairs[i, 0], pairs[i, 1]
            if best_a < 0 or not best_t < t_cur * (1 - 1e-9):
                break
            for x in range(m):
                v = perm[r, x]
                perm[r, x] = best_b if v == best_a else (best_a if v == best_b else v)
            t_cur = best_t
    return perm


@jit
def _allowed(a, b, feeds, inv, flow_in, flow_out, budget, use_budget):
    """Whether swapping slots ``a < b`` keeps every sample's E set at or before its L set
    and the buffer within ``budget`` after every boundary (``inv``: old slot at each slot)."""
    # it puts an L set before its E set only where a sample goes from slot a to a slot up
    # to b, or to slot b from a slot from a on
    for y in range(a + 1, b + 1):
        if feeds[a, y]:
            return False
    for x in range(a, b):
        if feeds[x, b]:
            return False
    if use_budget:
        held = 0.0
        for y in range(inv.shape[0]):
            o = inv[b] if y == a else (inv[a] if y == b else inv[y])
            held = held + (flow_in[o] - flow_out[o])
            if np.rint(held) > budget:
                return False
    return True
