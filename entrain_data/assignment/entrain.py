"""Entrain's hierarchical microbatch assignment (arXiv 2605.27918, section 4), vectorised.

Level 1 splits the global batch across DP replicas so that every replica's
*vector* of per-module sums (each encoder, the LLM) matches: greedy
largest-first placement in rounds, then pairwise swaps that shrink the worst
relative deviation on any module.

Level 2 composes, inside every replica, M microbatches in two layers:

- encoder sets E_j: longest-processing-time placement of the encoder work, so
  every microbatch carries the same encoder work; the sets are then ordered so
  that early microbatches carry more LLM work than average (their surplus is
  what deferral moves later);
- LLM sets L_j: microbatch by microbatch, pick from the samples encoded so far
  (and the text-only ones) a set whose LLM work meets the running target
  ``remaining / microbatches left``, largest first, under the token cap; the
  rest waits in the encoder-output buffer, whose token total may not exceed the
  deferral budget (the oldest waiting samples are consumed first when it would).

Samples without encoder work are never buffered: their encoder set is their
LLM set. A replica for which deferral cannot meet the cap or budget falls back
to joint sets (E_j == L_j) packed first-fit-decreasing under the cap, so the
invariants hold for every input the validation accepts, or a clear error says
why the cap cannot be met.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidInput
from .common import Assignment, Inputs, rng_for

__all__ = ["assign_entrain", "split_replicas", "lpt_bins"]

_SWAP_CANDIDATES = 64  # members considered per replica in one swap step
_GOOD_ENOUGH = 2e-3
_GREEDY_ROUNDS = 64  # level-1 rounds placed greedily; the rest, small items, in serpentine
_ITEMWISE_LPT = 512
_ALL_CANDIDATES_BELOW = 4096  # global batches this small try every level-2 candidate  # rows up to this many items are placed one item at a time  # relative deviation of a replica's module sum below which swaps stop


def _norm_columns(w: np.ndarray) -> np.ndarray:
    """Scale every column to mean 1 (zero columns stay zero) so modules weigh alike."""
    mean = w.mean(axis=0)
    scale = np.where(mean > 0, mean, 1.0)
    return w / scale


def split_replicas(
    w: np.ndarray, dp: int, rng: np.random.Generator, swap_iters: int | None = None
) -> np.ndarray:
    """Level 1: [dp, n] member matrix (-1 pads) with matched per-module sums.

    ``w`` is [B, D] per-sample work per module, already on a common scale.
    Counts differ by at most one between replicas.
    """
    b, d = w.shape
    if dp == 1:
        return np.arange(b, dtype=np.int64)[None, :]
    n = -(-b // dp)
    perm = rng.permutation(b)  # seeded tie-break
    key = w.sum(axis=1)
    order = perm[np.argsort(-key[perm], kind="stable")]
    order = np.concatenate([order, np.full(n * dp - b, -1, dtype=np.int64)])
    wp = np.vstack([w, np.zeros((1, d))])  # row -1 -> zeros
    members = np.empty((dp, n), dtype=np.int64)
    loads = np.zeros((dp, d))
    greedy = min(n, _GREEDY_ROUNDS)
    for k in range(greedy):
        items = order[k * dp : (k + 1) * dp]
        lightest = np.argsort(loads.sum(axis=1), kind="stable")
        members[lightest, k] = items
        loads[lightest] += wp[items]
    if greedy < n:
        # the small tail: serpentine rounds (lightest first, then back), in one step
        lightest = np.argsort(loads.sum(axis=1), kind="stable")
        tail = order[greedy * dp :].reshape(n - greedy, dp)
        tail[1::2] = tail[1::2, ::-1]
        members[lightest, greedy:] = tail.T
        loads[lightest] += wp[tail].sum(axis=0)
    _refine_replicas(members, loads, wp, swap_iters if swap_iters is not None else min(2 * dp, 16))
    return members


def _refine_replicas(members: np.ndarray, loads: np.ndarray, wp: np.ndarray, iters: int) -> None:
    """Pairwise swaps between the worst replica and its most complementary one."""
    dp, n = members.shape
    mean = loads.mean(axis=0)
    scale = np.where(mean > 0, mean, 1.0)
    cols = np.arange(n)
    if n > _SWAP_CANDIDATES:
        cols = np.linspace(0, n - 1, _SWAP_CANDIDATES).astype(np.int64)
    tried: set[tuple[int, int]] = set()
    for _ in range(iters):
        rel = (loads - mean) / scale  # [dp, D]
        obj = np.abs(rel).max(axis=1)
        a = int(np.argmax(obj))
        if obj[a] < _GOOD_ENOUGH:
            break
        dim = int(np.argmax(np.abs(rel[a])))
        sign = np.sign(rel[a, dim])
        cand = np.argsort(sign * rel[:, dim], kind="stable")
        b = next((int(c) for c in cand if c != a and (a, int(c)) not in tried), None)
        if b is None:
            break
        ia, ib = members[a, cols], members[b, cols]
        delta = wp[ia][:, None, :] - wp[ib][None, :, :]  # [na, nb, D]
        new_a = (loads[a] - delta - mean) / scale
        new_b = (loads[b] + delta - mean) / scale
        new_obj = np.maximum(np.abs(new_a).max(axis=2), np.abs(new_b).max(axis=2))
        best = int(np.argmin(new_obj))
        x, y = divmod(best, len(cols))
        if new_obj[x, y] >= max(obj[a], obj[b]) - 1e-12:
            tried.add((a, b))
            continue
        tried.clear()
        ca, cb = cols[x], cols[y]
        loads[a] -= delta[x, y]
        loads[b] += delta[x, y]
        members[a, ca], members[b, cb] = members[b, cb], members[a, ca]


def lpt_bins(cost: np.ndarray, valid: np.ndarray, m: int) -> np.ndarray:
    """Largest-first placement of [R, n] items into m bins per row; returns bin ids (-1 invalid).

    Short rows: classic LPT, one item at a time. Long rows: rounds of m items, largest
    first, the round's largest item to the lightest bin, its second to the second
    lightest, and so on (LPT vectorised over a round: the loop runs n / m times, not n). :func:`refine_bins` then removes what this leaves.
    """
    r, n = cost.shape
    key = np.where(valid, cost, -np.inf)
    order = np.argsort(-key, axis=1, kind="stable")
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
    for _ in range(iters):
        counts = np.zeros((r_count, m + 1), dtype=np.int64)
        np.add.at(counts, (flat_rows, slot), 1)
        loads = np.zeros((r_count, m + 1))
        np.add.at(loads, (flat_rows, slot), c)
        loads = loads[:, :m]
        h = np.argmax(loads, axis=1)
        lo = np.argmin(loads, axis=1)
        gap = loads[rows, h] - loads[rows, lo]
        # members of h and lo, each sorted by cost, padded to k
        key = slot * span + c
        order = np.argsort(key, axis=1, kind="stable")
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


def _ffd_joint(
    cost: np.ndarray, tok: np.ndarray, m: int, cap: int | None, where: str
) -> np.ndarray:
    """Bins for one replica with E == L: least-loaded-that-fits, largest first, under ``cap``."""
    n = len(cost)
    order = np.argsort(-cost, kind="stable")
    loads = np.zeros(m)
    toks = np.zeros(m, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for i in order:
        fits = np.ones(m, bool) if cap is None else toks + tok[i] <= cap
        if not fits.any():
            raise InvalidInput(
                f"{where}: cannot pack {int(tok.sum())} tokens into {m} microbatches of "
                f"max_tokens={cap} (sample {int(i)} does not fit); raise max_tokens or microbatches"
            )
        j = int(np.argmin(np.where(fits, loads, np.inf)))
        out[i] = j
        loads[j] += cost[i]
        toks[j] += tok[i]
    return out


def vector_bins(w: np.ndarray, valid: np.ndarray, m: int) -> np.ndarray:
    """[R, n] bin ids (-1 invalid) balancing every column of ``w`` [R, n, D] at once.

    Items largest first (by their largest column share); each goes to the bin whose
    worst column, relative to that column's per-bin target, is lowest after adding it
    (vector LPT: the max-normalised-load objective). Short rows item by item, long rows
    in rounds of m (one item per bin per round, the round's largest to the best bin).
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
    if n <= _ITEMWISE_LPT:
        for t in range(n):
            item = order[:, t]
            ok = valid[rows, item]
            if not ok.any():
                break
            after = (loads + wn[rows, item][:, None, :]).max(axis=2)  # [R, m]
            j = np.argmin(after + 1e-9 * loads.sum(axis=2) + 1e-12 * counts, axis=1)
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


def _order_by_llm(ebin, members_ok, llm, m):
    """Renumber E bins so that the LLM-heaviest comes first (deferral moves surplus later)."""
    r_count = llm.shape[0]
    rows = np.arange(r_count)[:, None]
    bin_llm = np.zeros((r_count, m))
    np.add.at(
        bin_llm, (np.broadcast_to(rows, ebin.shape)[members_ok], ebin[members_ok]), llm[members_ok]
    )
    rank = np.argsort(np.argsort(-bin_llm, axis=1, kind="stable"), axis=1)
    return np.where(members_ok, np.take_along_axis(rank, np.maximum(ebin, 0), axis=1), -1)


_MOUNTAIN = True
_EDGE_WEIGHT = 0.05  # 1F1B fill/drain: a heavy first or last microbatch costs the whole pipe
_ENC_SLACK = 0.10  # a candidate's encoder CV may exceed the LPT sets' by this share


def _order_mountain(ebin, ok, enc_w, llm, m):
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


def _score(eidx, lidx, valid, enc_cols, llm, m):
    """[R] how unbalanced a candidate is: the sum over modules (each encoder from E, the
    LLM from L) of the squared CV of per-microbatch load, plus the worst peak/mean as a
    small tie-break. Squared CVs favour candidates with no badly balanced module.
    Also returns the worst encoder column's CV (encoder balance comes first)."""
    r_count = llm.shape[0]
    rr = np.broadcast_to(np.arange(r_count)[:, None], llm.shape)
    cols = [(eidx, enc_cols[..., e]) for e in range(enc_cols.shape[2])] + [(lidx, llm)]
    score = np.zeros(r_count)
    worst = np.zeros(r_count)
    enc_cv = np.zeros(r_count)
    for k, (idx, c) in enumerate(cols):
        ok = valid & (idx >= 0)
        loads = np.zeros((r_count, m))
        np.add.at(loads, (rr[ok], idx[ok]), c[ok])
        mean = loads.mean(axis=1)
        safe = np.where(mean > 0, mean, 1.0)
        cv = np.where(mean > 0, loads.std(axis=1) / safe, 0.0)
        score += cv**2
        if k < len(cols) - 1:
            enc_cv = np.maximum(enc_cv, cv)
        worst = np.maximum(worst, np.where(mean > 0, loads.max(axis=1) / safe, 1.0))
        edge = np.maximum(loads[:, 0], loads[:, -1]) / safe - 1.0
        score += _EDGE_WEIGHT * np.where(mean > 0, np.maximum(edge, 0.0), 0.0) / len(cols)
    return score + 1e-3 * worst, enc_cv


def _fits_cap(bins, valid, tok, m, cap):
    """[R] whether every bin of joint sets ``bins`` stays within the token cap."""
    r_count = tok.shape[0]
    if cap is None:
        return np.ones(r_count, bool)
    t_load = np.zeros((r_count, m), dtype=np.int64)
    rr = np.broadcast_to(np.arange(r_count)[:, None], tok.shape)
    np.add.at(t_load, (rr[valid], bins[valid]), tok[valid])
    return (t_load <= cap).all(axis=1)


def assign_entrain(x: Inputs, seed: int, iteration: int, tolerance: float = 0.02) -> Assignment:
    """Entrain's two-level assignment of ``x`` (see the module docstring)."""
    rng = rng_for(seed, iteration, 1)
    r_count, m = x.dp, x.microbatches
    w = _norm_columns(np.concatenate([x.enc, x.llm[:, None]], axis=1))
    members = split_replicas(w, r_count, rng)  # [R, n]
    valid = members >= 0
    safe = np.where(valid, members, 0)
    enc_cols = np.where(valid[..., None], x.enc[safe], 0.0)  # [R, n, E]
    enc_w = np.where(valid, _norm_columns(x.enc)[safe].sum(axis=2), 0.0)  # [R, n]
    llm = np.where(valid, x.llm[safe], 0.0)
    tok = np.where(valid, x.tokens[safe], 0)
    has_enc = valid & (x.enc[safe].sum(axis=2) > 0)
    cap, budget = x.max_tokens, x.defer_budget

    # candidate A: encoder sets by LPT over encoder work alone, LLM sets by deferral
    ebin = lpt_bins(enc_w, has_enc, m)
    per_bin = members.shape[1] / m
    refine_bins(ebin, enc_w, has_enc, m, iters=2 * m if per_bin <= 16 else max(4, m // 2))
    eidx = (
        _order_mountain(ebin, has_enc, enc_w, llm, m)
        if _MOUNTAIN
        else _order_by_llm(ebin, has_enc, llm, m)
    )
    lidx2, failed2 = _llm_sets_lpt(eidx, has_enc, valid, llm, tok, m, cap, budget)
    cands = [(eidx, lidx2, failed2)]
    if x.n < _ALL_CANDIDATES_BELOW:
        cands += _more_candidates(
            eidx, has_enc, valid, enc_cols, llm, tok, m, cap, budget, tolerance
        )
    return _pick(cands, x, members, valid, has_enc, enc_cols, enc_w, llm, tok, m)


def _more_candidates(eidx, has_enc, valid, enc_cols, llm, tok, m, cap, budget, tolerance):
    """The costlier candidates, tried where the batch is small enough to afford them."""
    lidx, failed = _llm_sets(eidx, has_enc, valid, llm, tok, m, cap, budget, tolerance)
    cands = [(eidx, lidx, failed)]
    # the same encoder sets, LLM-heaviest first: the most room for deferral
    ebin = np.where(has_enc, eidx, -1)
    eidx_d = _order_by_llm(ebin, has_enc, llm, m)
    for builder in (_llm_sets, _llm_sets_lpt):
        args = (eidx_d, has_enc, valid, llm, tok, m, cap, budget)
        lidx_d, failed_d = builder(*args, tolerance) if builder is _llm_sets else builder(*args)
        cands.append((eidx_d, lidx_d, failed_d))

    # candidate B: encoder sets balancing every encoder column, the LLM and tokens together
    # (vector LPT); their LLM sets are the encoder sets themselves or a deferral of them
    wv = np.concatenate([enc_cols, llm[..., None], tok[..., None].astype(np.float64)], axis=2)
    vb = _order_by_llm(vector_bins(wv, valid, m), valid, llm, m)
    joint_ok = _fits_cap(vb, valid, tok, m, cap)
    cands.append((vb, vb, ~joint_ok))
    # candidate C: joint sets balancing the LLM and tokens only (what the LLM peers aim at)
    wl = np.stack([llm, tok.astype(np.float64)], axis=2)
    lb = vector_bins(wl, valid, m)
    cands.append((lb, lb, ~_fits_cap(lb, valid, tok, m, cap)))
    veidx = np.where(has_enc, vb, -1)
    lidx3, failed3 = _llm_sets_lpt(veidx, has_enc, valid, llm, tok, m, cap, budget)
    cands.append((veidx, lidx3, failed3))
    return cands


def _pick(cands, x, members, valid, has_enc, enc_cols, enc_w, llm, tok, m):
    """Per replica the best-scoring candidate; replicas where all fail get joint FFD sets."""
    r_count = x.dp
    eidx = cands[0][0]
    best_score = np.full(r_count, np.inf)
    eidx_out = np.zeros_like(eidx)
    lidx_out = np.zeros_like(eidx)
    failed = np.ones(r_count, bool)
    enc_ref = None
    for ce, cl, cf in cands:
        e_eff = np.where(has_enc, ce, cl)
        sc, ecv = _score(e_eff, cl, valid, enc_cols, llm, m)
        if enc_ref is None:  # the first candidate's encoder sets are LPT-tight: the reference
            enc_ref = np.where(cf, np.inf, ecv)
        # the encoders produce at a constant rate first: no candidate may give that up
        sc = np.where(cf | (ecv > enc_ref * (1 + _ENC_SLACK) + 1e-3), np.inf, sc)
        better = sc < best_score
        best_score = np.where(better, sc, best_score)
        eidx_out = np.where(better[:, None], e_eff, eidx_out)
        lidx_out = np.where(better[:, None], cl, lidx_out)
        failed &= cf
    eidx, lidx = eidx_out, lidx_out
    for r in np.flatnonzero(failed):
        v = valid[r]
        joint = _ffd_joint(
            llm[r, v] + enc_w[r, v] * 1e-9, tok[r, v], m, x.max_tokens, f"replica {int(r)}"
        )
        eidx[r, v] = joint
        lidx[r, v] = joint
    eidx, lidx = _edges_light(eidx, lidx, valid, enc_w, llm, m)
    return _to_assignment("entrain", members, valid, eidx, lidx, r_count, m)


def _edges_light(eidx, lidx, valid, enc_w, llm, m):
    """Reorder the microbatches of replicas without deferral so the heaviest sit in the middle.

    1F1B pays the first microbatch's forward and the last one's backward across every
    stage (fill and drain) on top of the steady state; heavy microbatches there lengthen
    the iteration, in the middle they are absorbed. Replicas that defer keep their order:
    a permutation could put a sample's LLM set before its encoder set.
    """
    r_count = llm.shape[0]
    joint = ((eidx == lidx) | ~valid).all(axis=1)
    if not joint.any() or m < 3:
        return eidx, lidx
    rows = np.arange(r_count)[:, None]
    tot = enc_w / max(float(enc_w[valid].mean()), 1e-30) + llm / max(
        float(llm[valid].mean()), 1e-30
    )
    load = np.zeros((r_count, m))
    ok = valid & (lidx >= 0)
    np.add.at(load, (np.broadcast_to(rows, lidx.shape)[ok], lidx[ok]), tot[ok])
    # positions from the centre outwards: the heaviest microbatch gets the centre
    centre = (m - 1) / 2
    pos_order = np.argsort(np.abs(np.arange(m) - centre), kind="stable")
    heavy_first = np.argsort(-load, axis=1, kind="stable")  # [R, m] old bin ids
    newpos = np.empty((r_count, m), dtype=np.int64)
    np.put_along_axis(newpos, heavy_first, np.broadcast_to(pos_order, (r_count, m)), axis=1)
    remap = np.where(joint[:, None], newpos, np.arange(m)[None, :])
    e2 = np.where(valid, np.take_along_axis(remap, np.maximum(eidx, 0), axis=1), eidx)
    l2 = np.where(valid, np.take_along_axis(remap, np.maximum(lidx, 0), axis=1), lidx)
    return e2, l2


def _llm_sets(eidx, has_enc, valid, llm, tok, m, cap, budget, tol):
    """LLM microbatch of every member ([R, n]) and the replicas where deferral failed."""
    r_count, n = llm.shape
    rows = np.arange(r_count)
    lidx = np.full((r_count, n), -1, dtype=np.int64)
    consumed = ~valid
    failed = np.zeros(r_count, bool)
    big = np.iinfo(np.int64).max // 4
    cap_v = big if cap is None else cap
    for j in range(m):
        avail = ~consumed & ((eidx <= j) | ~has_enc)
        remaining = np.where(consumed, 0.0, llm).sum(axis=1)
        if j == m - 1:
            take = avail.copy()
            ntok = np.where(take, tok, 0).sum(axis=1)
            failed |= ntok > cap_v
            failed |= (~consumed & ~take).any(axis=1)
        else:
            target = remaining / (m - j)
            take, ntok = _fill(avail, llm, tok, target * (1 + tol), cap_v)
            if budget is not None:
                waiting = has_enc & (eidx <= j) & ~consumed & ~take
                buffered = np.where(waiting, tok, 0).sum(axis=1)
                if (buffered > budget).any():
                    # consume the oldest waiting samples first
                    okey = np.where(waiting, eidx * (n + 1) + np.arange(n)[None, :], big)
                    order = np.argsort(okey, axis=1, kind="stable")
                    width = int(waiting.sum(axis=1).max())
                    for t in range(width):
                        item = order[:, t]
                        need = waiting[rows, item] & (buffered > budget)
                        tk = tok[rows, item]
                        fits = need & (ntok + tk <= cap_v)
                        take[rows[fits], item[fits]] = True
                        ntok += np.where(fits, tk, 0)
                        buffered -= np.where(fits, tk, 0)
                    failed |= buffered > budget
        lidx[take] = j
        consumed |= take
    return lidx, failed


def _llm_sets_lpt(eidx, has_enc, valid, llm, tok, m, cap, budget):
    """LLM microbatch of every member ([R, n]) by release-constrained LPT.

    Largest LLM work first, each sample goes to the least LLM-loaded microbatch
    j >= its encoder microbatch (its release) such that the token cap holds in
    j and the deferral buffer stays within budget at every boundary it waits
    across. Text-only samples are released at 0 (they are encoded where
    consumed). Rows where some sample fits nowhere are reported failed.
    """
    r_count, n = llm.shape
    rows = np.arange(r_count)
    big = np.iinfo(np.int64).max // 4
    cap_v = big if cap is None else cap
    bud_v = big if budget is None else budget
    release = np.where(has_enc, eidx, 0)
    order = np.argsort(-np.where(valid, llm, -np.inf), axis=1, kind="stable")
    lidx = np.full((r_count, n), -1, dtype=np.int64)
    loads = np.zeros((r_count, m))
    toks = np.zeros((r_count, m), dtype=np.int64)
    buffered = np.zeros((r_count, m), dtype=np.int64)  # tokens waiting after boundary j
    failed = np.zeros(r_count, bool)
    jj = np.arange(m)[None, :]
    for t in range(n):
        item = order[:, t]
        ok = valid[rows, item]
        if not ok.any():
            break
        rel = release[rows, item][:, None]
        tk = tok[rows, item][:, None]
        buf_ok = (buffered + tk <= bud_v) | (jj < rel) | ~has_enc[rows, item][:, None]
        # j is reachable when every boundary rel..j-1 can hold the sample while it waits
        reach = np.cumprod(np.concatenate([np.ones((r_count, 1), bool), buf_ok[:, :-1]], 1), 1)
        fits = (jj >= rel) & reach.astype(bool) & (toks + tk <= cap_v)
        none = ok & ~fits.any(axis=1)
        failed |= none
        place = ok & ~none
        j = np.argmin(np.where(fits, loads + 1e-12 * toks, np.inf), axis=1)
        rr = rows[place]
        jp = j[place]
        lidx[rr, item[place]] = jp
        loads[rr, jp] += llm[rr, item[place]]
        toks[rr, jp] += tok[rr, item[place]]
        wait = place & has_enc[rows, item]
        span = (jj >= rel) & (jj < j[:, None]) & wait[:, None]
        buffered += np.where(span, tk, 0)
    return lidx, failed


def _grouped(members: np.ndarray, slot: np.ndarray, count: int) -> list[np.ndarray]:
    """Members grouped by slot (0..count-1), ascending sample order inside a group."""
    order = np.lexsort((members, slot))
    bounds = np.searchsorted(slot[order], np.arange(count + 1))
    ms = members[order]
    return [ms[bounds[k] : bounds[k + 1]] for k in range(count)]


def _fill(avail, cost, tok, limit, cap, fills: int = 3):
    """Per row, items with total cost near ``limit`` under the token ``cap`` (at least one).

    Largest first while the running sum stays within the limit, then up to
    ``fills`` times the largest remaining item that still fits the gap.
    """
    r_count, n = cost.shape
    rows = np.arange(r_count)
    order = np.argsort(-np.where(avail, cost, -np.inf), axis=1, kind="stable")
    a_s = np.take_along_axis(avail, order, 1)
    c_s = np.take_along_axis(np.where(avail, cost, 0.0), order, 1)
    t_s = np.take_along_axis(np.where(avail, tok, 0), order, 1)
    ok = a_s & (np.cumsum(c_s, 1) <= limit[:, None]) & (np.cumsum(t_s, 1) <= cap)
    length = np.where(ok.all(axis=1), n, np.argmin(ok, axis=1))
    length = np.where(a_s[:, 0] & (length == 0), 1, length)
    take_s = np.arange(n)[None, :] < length[:, None]
    take = np.zeros_like(avail)
    np.put_along_axis(take, order, take_s, axis=1)
    load = (c_s * take_s).sum(axis=1)
    ntok = (t_s * take_s).sum(axis=1)
    for _ in range(fills):
        cand = avail & ~take & (cost <= (limit - load)[:, None]) & (tok <= (cap - ntok)[:, None])
        best = np.argmax(np.where(cand, cost, -1.0), axis=1)
        has = cand[rows, best]
        if not has.any():
            break
        take[rows[has], best[has]] = True
        load += np.where(has, cost[rows, best], 0.0)
        ntok += np.where(has, tok[rows, best], 0)
    return take, ntok


def _to_assignment(method, members, valid, eidx, lidx, r_count, m) -> Assignment:
    """Collect per-(replica, microbatch) index arrays (ascending sample order inside a set)."""
    rep = np.broadcast_to(np.arange(r_count)[:, None], members.shape)[valid]
    mem = members[valid]
    enc = _grouped(mem, rep * m + eidx[valid], r_count * m)
    llm = _grouped(mem, rep * m + lidx[valid], r_count * m)
    enc_sets = [enc[r * m : (r + 1) * m] for r in range(r_count)]
    llm_sets = [llm[r * m : (r + 1) * m] for r in range(r_count)]
    return Assignment(method, r_count, m, enc_sets, llm_sets)
