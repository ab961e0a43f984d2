"""Level 2, first layer: the encoder sets E_j of every replica.

Largest-first placement of per-sample work into the M microbatches of each
replica (one column, :func:`lpt_bins` then :func:`refine_bins`; or every
column at once, :func:`vector_bins`), vectorised over replicas, and the
orderings of the resulting bins (LLM-heaviest first, or heaviest in the middle).
"""

from __future__ import annotations

import numpy as np

from .. import compiled
from .common import slot_sums

__all__ = [
    "lpt_bins",
    "refine_bins",
    "vector_bins",
    "refine_vector",
    "order_by_llm",
    "order_mountain",
]

_ITEMWISE_LPT = 512  # rows up to this many items are placed one item at a time
_PAIR_ITEMS = 32  # refine_vector tries moves and swaps among this many items of each bin


def lpt_bins(cost: np.ndarray, valid: np.ndarray, m: int) -> np.ndarray:
    """Largest-first placement of [R, n] items into m bins per row; returns bin ids (-1 invalid).

    Short rows: classic LPT, one item at a time. Long rows: rounds of m items, largest
    first, the round's largest item to the lightest bin, its second to the second
    lightest, and so on (LPT vectorised over a round: the loop runs n / m times, not n). :func:`refine_bins` then removes what this leaves.
    """
    r, n = cost.shape
    key = np.where(valid, cost, -np.inf)
    order = np.argsort(-key, axis=1, kind="stable")
    if n <= _ITEMWISE_LPT and compiled.enabled():
        from . import sets_kernel  # numba is imported with it

        return sets_kernel.lpt_items(np.ascontiguousarray(cost, dtype=np.float64), order, valid, m)
    bins = np.full((r, n), -1, dtype=np.int64)
    loads = np.zeros((r, m))
    rows = np.arange(r)[:, None]
    counts = np.zeros((r, m))
    step = 1 if n <= _ITEMWISE_LPT else m  # item by item where it is cheap: tighter bins
    for t in range(0, n, step):
        item = order[:, t : t + step]
        w = item.shape[1]
        ok = valid[rows, item]
        if not ok.any():
            break
        # lightest bins first; among equal loads the one with fewer items
        target = np.argsort(loads + counts * 1e-12, axis=1, kind="stable")[:, :w]
        rr = np.broadcast_to(rows, item.shape)[ok]
        bins[rr, item[ok]] = target[ok]
        np.add.at(loads, (rr, target[ok]), cost[rr, item[ok]])
        np.add.at(counts, (rr, target[ok]), 1)
    return bins


def refine_bins(bins: np.ndarray, cost: np.ndarray, valid: np.ndarray, m: int, iters: int) -> None:
    """Improve [R, n] bin ids in place: swap (or move) items between each row's heaviest and
    lightest bin when that narrows their gap; LPT leaves up to a third of a bin on the table
    when bins hold few items, and this recovers most of it.

    Only the two bins' members are compared, and for each item of the heavy bin only the
    light-bin items nearest the ideal partner (found by binary search), so a step costs
    O(R * n log n), not O(R * n^2).
    """
    r_count, n = bins.shape
    if n == 0 or m < 2:
        return
    rows = np.arange(r_count)
    c = np.where(valid, cost, 0.0)
    slot = np.where(valid, bins, m)  # invalid items in an extra, ignored bin
    flat_rows = np.broadcast_to(rows[:, None], slot.shape)
    span = 4.0 * (float(c.max()) + 1.0) * (1 + n)
    if compiled.enabled():
        from . import sets_kernel  # numba is imported with it

        sets_kernel.refine_bins_rows(slot, np.ascontiguousarray(c), m, iters, span)
        bins[:] = np.where(valid, slot, -1)
        return
    for _ in range(iters):
        counts = np.zeros((r_count, m + 1), dtype=np.int64)
        np.add.at(counts, (flat_rows, slot), 1)
        loads = np.zeros((r_count, m + 1))
        np.add.at(loads, (flat_rows, slot), c)
        loads = loads[:, :m]
        h = np.argmax(loads, axis=1)
        lo = np.argmin(loads, axis=1)
        gap = loads[rows, h] - loads[rows, lo]
        # members of h and lo, each sorted by cost (ties by index), padded to k
        order = np.lexsort((c, slot), axis=1)
        starts = np.cumsum(counts, axis=1) - counts
        nh, nl = counts[rows, h], counts[rows, lo]
        k = int(max(nh.max(), nl.max(), 1))
        ar = np.arange(k)[None, :]
        ih = np.take_along_axis(order, np.minimum(starts[rows, h][:, None] + ar, n - 1), axis=1)
        il = np.take_along_axis(order, np.minimum(starts[rows, lo][:, None] + ar, n - 1), axis=1)
        vh = ar < nh[:, None]
        ch = np.take_along_axis(c, ih, axis=1)
        # light-bin costs, ascending, with a 0 (a move) in front; pads sort last in their row
        cl = np.where(ar < nl[:, None], np.take_along_axis(c, il, axis=1), span / 2)
        cl = np.concatenate([np.zeros((r_count, 1)), cl], axis=1)  # [R, k + 1]
        flat = (cl + rows[:, None] * span).ravel()
        want = ch - gap[:, None] / 2 + rows[:, None] * span
        pos = np.searchsorted(flat, want.ravel()).reshape(r_count, k) - rows[:, None] * (k + 1)
        best_gap = np.full(r_count, np.inf)
        best_a = np.zeros(r_count, dtype=np.int64)
        best_b = np.zeros(r_count, dtype=np.int64)
        for p in (pos - 1, pos):
            p = np.clip(p, 0, k)
            cand = np.take_along_axis(cl, p, axis=1)
            valid_b = (p == 0) | (p - 1 < nl[:, None])
            ng = np.abs(gap[:, None] - 2 * (ch - cand))
            ng = np.where(vh & valid_b, ng, np.inf)
            a = np.argmin(ng, axis=1)
            g = ng[rows, a]
            upd = g < best_gap
            best_gap = np.where(upd, g, best_gap)
            best_a = np.where(upd, a, best_a)
            best_b = np.where(upd, p[rows, a], best_b)
        better = best_gap < gap - 1e-12 * np.maximum(gap, 1.0)
        if not better.any():
            break
        rr = rows[better]
        slot[rr, ih[rr, best_a[better]]] = lo[better]
        swap = better & (best_b > 0)
        rs = rows[swap]
        slot[rs, il[rs, best_b[swap] - 1]] = h[swap]
    bins[:] = np.where(valid, slot, -1)


def vector_bins(
    w: np.ndarray, valid: np.ndarray, m: int, weight: np.ndarray | None = None
) -> np.ndarray:
    """[R, n] bin ids (-1 invalid) balancing every column of ``w`` [R, n, D] at once.

    Items largest first (by their largest column share); each goes to the bin whose
    worst column, relative to that column's per-bin target, is lowest after adding it
    (vector LPT: the max-normalised-load objective). Short rows item by item, long rows
    in rounds of m (one item per bin per round, the round's largest to the best bin).
    Among bins equally good the one with the least total relative load wins, each column
    counted ``weight`` [D] times (as that many copies of it would, without their cost).
    """
    r_count, n, d = w.shape
    target = np.where(valid[..., None], w, 0.0).sum(axis=1) / m  # [R, D]
    wn = w / np.where(target > 0, target, 1.0)[:, None, :]
    key = np.where(valid, wn.max(axis=2), -np.inf)
    order = np.argsort(-key, axis=1, kind="stable")
    bins = np.full((r_count, n), -1, dtype=np.int64)
    loads = np.zeros((r_count, m, d))
    rows = np.arange(r_count)
    counts = np.zeros((r_count, m))
    weight = np.ones(d) if weight is None else np.asarray(weight, dtype=np.float64)
    if n <= _ITEMWISE_LPT and compiled.enabled():
        from . import sets_kernel  # numba is imported with it

        return sets_kernel.vector_lpt(np.ascontiguousarray(wn), order, valid, m, weight)
    if n <= _ITEMWISE_LPT:
        for t in range(n):
            item = order[:, t]
            ok = valid[rows, item]
            if not ok.any():
                break
            after = (loads + wn[rows, item][:, None, :]).max(axis=2)  # [R, m]
            total = np.cumsum(loads * weight, axis=2)[..., -1]  # sequential, as the compiled twin's
            j = np.argmin(after + 1e-9 * total + 1e-12 * counts, axis=1)
            rr = rows[ok]
            bins[rr, item[ok]] = j[ok]
            loads[rr, j[ok]] += wn[rr, item[ok]]
            counts[rr, j[ok]] += 1
        return bins
    rr2 = rows[:, None]
    for t in range(0, n, m):
        item = order[:, t : t + m]
        ok = valid[rr2, item]
        if not ok.any():
            break
        target_bins = np.argsort(loads.max(axis=2) + 1e-12 * counts, axis=1, kind="stable")
        tb = target_bins[:, : item.shape[1]]
        rr = np.broadcast_to(rr2, item.shape)[ok]
        bins[rr, item[ok]] = tb[ok]
        np.add.at(loads, (rr, tb[ok]), wn[rr, item[ok]])
        np.add.at(counts, (rr, tb[ok]), 1)
    return bins


def refine_vector(
    bins: np.ndarray,
    w: np.ndarray,
    valid: np.ndarray,
    m: int,
    iters: int,
    profile: np.ndarray | None = None,
    weight: np.ndarray | None = None,
) -> None:
    """Improve [R, n] bin ids of :func:`vector_bins` in place: move or swap items between each
    row's worst bin and the bin whose deviation from the per-bin target most opposes it (the
    next most opposed where that pair is stuck), when that lowers the two bins' sum over
    columns of squared relative deviation.

    Vector LPT fills a bin until its *worst* column reaches the target, so the other
    columns end unbalanced: where one column is a count (every clip padded to 30 s, every
    image at one resolution) its bins hold 3 or 5 items where 4 would balance every column.
    ``weight`` [D] counts each column's squared deviation that many times (as that many
    copies of the column would, without their cost).
    ``profile`` [R, m] (or [R, m, D], one per column) is each bin's share of the mean the
    refinement aims at (None: equal bins).
    Each step tries every (move, swap) among the ``_PAIR_ITEMS`` items of each bin whose leaving
    helps most (projected on the two bins' deviation difference; all of them in bins that small):
    O(R * (n + _PAIR_ITEMS^2) * D) a step, whatever the bins hold.
    """
    r_count, n, d = w.shape
    if n == 0 or m < 2:
        return
    rows = np.arange(r_count)
    target = np.where(valid[..., None], w, 0.0).sum(axis=1) / m  # [R, D]
    wn = np.where(valid[..., None], w / np.where(target > 0, target, 1.0)[:, None, :], 0.0)
    slot = np.where(valid, bins, m)  # invalid items in an extra, ignored bin
    prof = np.ones((r_count, m)) if profile is None else np.asarray(profile, dtype=np.float64)
    on = np.where(target > 0, 1.0, 0.0)[:, None, :]
    if weight is not None:  # a column counted k times: deviations scaled by sqrt(k)
        root = np.sqrt(np.asarray(weight, dtype=np.float64))
        wn = wn * root
        on = on * root
    prof = prof if prof.ndim == 3 else prof[:, :, None]  # [R, m, 1] or per column [R, m, D]
    dev = slot_sums(slot, wn, valid, m) - prof * on  # [R, m, D]
    if compiled.enabled():
        from . import sets_kernel  # numba is imported with it

        sets_kernel.refine_vector_rows(slot, np.ascontiguousarray(wn), dev, m, iters, _PAIR_ITEMS)
        bins[:] = np.where(valid, slot, -1)
        return
    counts = slot_sums(slot, np.ones((r_count, n)), valid, m)
    tries = np.zeros(r_count, dtype=np.int64)  # partners of the worst bin tried in vain
    for _ in range(iters):
        active = tries < m - 1
        if not active.any():
            break
        obj = _dot(dev, dev)  # [R, m]
        h = np.argmax(obj, axis=1)
        dh = dev[rows, h]  # [R, D]
        opp = _dot(dev, np.broadcast_to(dh[:, None, :], dev.shape))
        opp[rows, h] = np.inf
        b = np.argsort(opp, axis=1, kind="stable")[rows, np.minimum(tries, m - 2)]
        db = dev[rows, b]
        in_h = slot == h[:, None]
        in_b = slot == b[:, None]
        k = int(min(max(counts[rows, h].max(), counts[rows, b].max(), 1), _PAIR_ITEMS))
        # each bin's items that help most when they leave it first: along dh - db
        proj = _dot(wn, np.broadcast_to((dh - db)[:, None, :], wn.shape))  # [R, n]
        ih = np.argsort(np.where(in_h, -proj, np.inf), axis=1, kind="stable")[:, :k]
        ib = np.argsort(np.where(in_b, proj, np.inf), axis=1, kind="stable")[:, :k]
        vh = np.concatenate([np.ones((r_count, 1), bool), in_h[rows[:, None], ih]], axis=1)
        vb = np.concatenate([np.ones((r_count, 1), bool), in_b[rows[:, None], ib]], axis=1)
        zero = np.zeros((r_count, 1, d))
        xh = np.concatenate([zero, wn[rows[:, None], ih]], axis=1)  # [R, k+1, D] leaves h
        yb = np.concatenate([zero, wn[rows[:, None], ib]], axis=1)  # [R, k+1, D] leaves b
        new_h = dh[:, None, None, :] - xh[:, :, None, :] + yb[:, None, :, :]
        new_b = db[:, None, None, :] + xh[:, :, None, :] - yb[:, None, :, :]
        new = _dot(new_h, new_h) + _dot(new_b, new_b)  # [R, k+1, k+1]
        ok = vh[:, :, None] & vb[:, None, :]
        ok[:, 0, 0] = False
        # never empty a bin: a move out of a one-item bin needs an item back
        ok[:, 1:, 0] &= (counts[rows, h] > 1)[:, None]
        ok[:, 0, 1:] &= (counts[rows, b] > 1)[:, None]
        new = np.where(ok, new, np.inf).reshape(r_count, -1)
        best = np.argmin(new, axis=1)
        old = obj[rows, h] + obj[rows, b]
        gain = active & (new[rows, best] < old * (1 - 1e-9) - 1e-12)
        tries = np.where(gain, 0, tries + 1)  # stuck: the next most opposed bin
        x, y = np.divmod(best, k + 1)
        mx = gain & (x > 0)
        my = gain & (y > 0)
        slot[rows[mx], ih[rows[mx], x[mx] - 1]] = b[mx]
        slot[rows[my], ib[rows[my], y[my] - 1]] = h[my]
        ra = rows[gain]
        dev[ra, h[gain]] = new_h[ra, x[gain], y[gain]]
        dev[ra, b[gain]] = new_b[ra, x[gain], y[gain]]
        counts[rows[mx], h[mx]] -= 1
        counts[rows[mx], b[mx]] += 1
        counts[rows[my], b[my]] -= 1
        counts[rows[my], h[my]] += 1
    bins[:] = np.where(valid, slot, -1)


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sum over the last axis of ``a * b``, column by column (the compiled twin's order)."""
    out = a[..., 0] * b[..., 0]
    for q in range(1, a.shape[-1]):
        out = out + a[..., q] * b[..., q]
    return out


def order_by_llm(ebin, members_ok, llm, m):
    """Renumber E bins so that the LLM-heaviest comes first (deferral moves surplus later)."""
    r_count = llm.shape[0]
    rows = np.arange(r_count)[:, None]
    bin_llm = np.zeros((r_count, m))
    np.add.at(
        bin_llm, (np.broadcast_to(rows, ebin.shape)[members_ok], ebin[members_ok]), llm[members_ok]
    )
    rank = np.argsort(np.argsort(-bin_llm, axis=1, kind="stable"), axis=1)
    return np.where(members_ok, np.take_along_axis(rank, np.maximum(ebin, 0), axis=1), -1)


def order_mountain(ebin, ok, enc_w, llm, m):
    """Renumber bins so the heaviest (encoder + LLM, each normalised) sit in the middle."""
    r_count = llm.shape[0]
    rows = np.broadcast_to(np.arange(r_count)[:, None], ebin.shape)
    tot = enc_w / max(float(enc_w[ok].mean()) if ok.any() else 1.0, 1e-30) + llm / max(
        float(llm[ok].mean()) if ok.any() else 1.0, 1e-30
    )
    load = np.zeros((r_count, m))
    np.add.at(load, (rows[ok], ebin[ok]), tot[ok])
    centre = (m - 1) / 2
    pos_order = np.argsort(np.abs(np.arange(m) - centre), kind="stable")
    heavy_first = np.argsort(-load, axis=1, kind="stable")
    newpos = np.empty((r_count, m), dtype=np.int64)
    np.put_along_axis(newpos, heavy_first, np.broadcast_to(pos_order, (r_count, m)), axis=1)
    return np.where(ok, np.take_along_axis(newpos, np.maximum(ebin, 0), axis=1), -1)
