"""Level 2's last step: the order of the slowest replicas' microbatches, searched on the
proxy pipeline.

1F1B does not run its microbatches alike: the first ones' forwards fill the pipeline and
the last ones' backwards drain it while other stages wait, so the same sets in another
order take another time. The candidates, the pipeline search and the light-work layout
decide *which* samples form each set; their order only follows rules of thumb (heaviest in
the middle for joint sets, :func:`.entrain._edges_light`; the deferral's own order for the
rest). On a replica that defers, that order was up to 1% slower than the best the same
sets reach (``real:librispeech``/vla-3b with frozen encoders at 8192 / dp 128, a slowest
replica: 0.3250 s by the proxy as picked, 0.3218 s after these swaps; see bench/RESULTS.md).
Over the balance bench the means against the best keeping peer rose at every setting
(paper 1.0442 -> 1.0473, frozen large 1.0282 -> 1.0300), within the machine's noise of the
latency at 8192 / dp 128 compiled (:mod:`.order_kernel`).

A move swaps two slots: the E set and the L set at slot ``a`` trade places with those at
``b``. No set changes, so no module's CV, no token or patch cap and no sample's company
changes; a swap is taken only where every sample's E set still runs at or before its L
set and the deferral buffer stays within its budget after every boundary. Every round
each searched replica takes its best swap (all ``m (m - 1) / 2`` priced at once: a swap
permutes the rows of the replica's [m, S] proxy loads, no slot sum is recomputed), while
one shortens it. An order fitted to one depth's fill and drain can lose on another: where
the plan's depth is not told the caller (:func:`.entrain._shaped_untold`) keeps it only where
no depth of :func:`.pipeline_search.depth_blind_pricer` runs the replica slower.
"""

from __future__ import annotations

import numpy as np

from .. import compiled
from .common import Replicas, relabel_slots, slot_sums
from .pipeline_search import _proxy_loads, _replica_times, _topo

__all__ = ["order_slowest"]

_FOCUS = 16  # replicas searched: the slowest by proxy time (they set the iteration's)
_ROUNDS = 24  # swaps per replica at most
# passes at most: after one, the slowest replica may be one not yet searched (at 8192 / dp 128
# the mean against the best keeping peer rose 1.0469 -> 1.0478, frozen 1.0296 -> 1.0300)
_PASSES = 4


def order_slowest(
    rp: Replicas, eidx: np.ndarray, lidx: np.ndarray, stage: tuple
) -> tuple[np.ndarray, np.ndarray]:
    """``(eidx, lidx)`` with the slowest replicas' slots reordered (see the module docstring):
    the ``_FOCUS`` slowest, then again the slowest not yet searched while the slowest of all
    is one of them (``_PASSES`` at most); the others, and replicas where no swap pays, as
    given. ``stage``: the (ef, lf, lb) of :func:`.pipeline_search.stage_costs` for ``rp``."""
    m, valid = rp.m, rp.valid
    if not rp.depth_known or m < 3 or eidx.size == 0:
        return eidx, lidx
    fwd_all, bwd_all = _proxy_loads(eidx, lidx, *stage, valid, m)  # [R, m, S]
    cur = _replica_times(fwd_all, bwd_all)
    done = np.zeros(len(cur), bool)
    eidx, lidx = eidx.copy(), lidx.copy()
    for _ in range(_PASSES):
        if done[int(np.argmax(cur))]:
            break  # the slowest replica is one already searched
        order = np.argsort(-np.where(done, -np.inf, cur), kind="stable")
        act = np.sort(order[: min(_FOCUS, int((~done).sum()))])
        done[act] = True
        cur[act] = _order_rows(rp, eidx, lidx, fwd_all, bwd_all, cur, act)
    return eidx, lidx


def _order_rows(rp, eidx, lidx, fwd_all, bwd_all, cur, act):
    """Reorder the slots of replicas ``act`` in ``eidx`` and ``lidx`` (in place); their new
    proxy times (``fwd_all``, ``bwd_all`` [R, m, S]: every replica's loads as given; ``cur``
    [R] their times)."""
    m, valid = rp.m, rp.valid
    fwd, bwd, t_now = fwd_all[act], bwd_all[act], cur[act]
    enc = valid[act] & rp.has_enc[act]
    e_a, l_a = eidx[act], lidx[act]
    e_enc, l_enc = np.where(enc, e_a, 0), np.where(enc, l_a, 0)
    tok = np.where(enc, rp.tok[act], 0).astype(np.float64)
    every = np.ones(enc.shape, bool)  # tokens entering and leaving the buffer at each slot
    flow_in, flow_out = slot_sums(e_a, tok, every, m), slot_sums(l_a, tok, every, m)
    budget = -1 if rp.budget is None else int(rp.budget)
    args = (fwd, bwd, e_enc, l_enc, enc, flow_in, flow_out, budget, budget >= 0, t_now, _ROUNDS)
    if compiled.enabled():
        from .order_kernel import swap_rounds  # numba is imported with it

        perm = swap_rounds(*args, _topo(m, fwd.shape[2]))
    else:
        perm = _swap_rounds(*args)
    eidx[act], lidx[act] = (
        relabel_slots(perm, e_a, valid[act]),
        relabel_slots(perm, l_a, valid[act]),
    )
    inv = np.argsort(perm, axis=1)
    rows = np.arange(len(act))[:, None]
    return _replica_times(fwd[rows, inv], bwd[rows, inv])


def _swap_rounds(fwd, bwd, e_enc, l_enc, enc, flow_in, flow_out, budget, use_budget, t_now, rounds):
    """[A, m] new slot of every old slot after the swap rounds (numpy; the compiled twin is
    :func:`.order_kernel.swap_rounds`, arguments as there)."""
    a_count, m = fwd.shape[:2]
    a_idx, b_idx = np.triu_indices(m, 1)
    swaps = np.broadcast_to(np.arange(m), (len(a_idx), m)).copy()  # [P, m]: new slot of each
    swaps[np.arange(len(a_idx)), a_idx] = b_idx
    swaps[np.arange(len(a_idx)), b_idx] = a_idx
    perm = np.broadcast_to(np.arange(m), (a_count, m)).copy()  # [A, m] old slot -> new slot
    rows = np.arange(a_count)
    ar, a_rows = rows[:, None, None], rows[:, None]
    for _ in range(rounds):
        cand = swaps[:, perm].transpose(1, 0, 2)  # [A, P, m]: a swap after the current order
        inv = np.empty_like(cand)  # new slot -> old slot
        np.put_along_axis(inv, cand, np.arange(m), axis=2)
        t = _replica_times(fwd[ar, inv], bwd[ar, inv])  # [A, P]
        by_slot = cand.transpose(0, 2, 1)  # [A, m, P]
        late = (by_slot[a_rows, e_enc] > by_slot[a_rows, l_enc]) & enc[..., None]  # [A, n, P]
        ok = ~late.any(axis=1)
        if use_budget:
            held = np.cumsum(flow_in[ar, inv] - flow_out[ar, inv], axis=2)
            ok &= (np.rint(held) <= budget).all(axis=2)
        t = np.where(ok, t, np.inf)
        best = np.argmin(t, axis=1)
        gain = t[rows, best] < t_now * (1 - 1e-9)
        if not gain.any():
            break
        perm = np.where(gain[:, None], cand[rows, best], perm)
        t_now = np.where(gain, t[rows, best], t_now)
    return perm
