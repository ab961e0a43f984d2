"""Level 2, second layer: the LLM sets L_j, by deferral under the token cap and budget.

A sample encoded in microbatch i may be consumed by the LLM in any j >= i
(its encoder output waits in a buffer of bounded tokens). Two builders, both
vectorised over replicas: a running-target fill (:func:`llm_sets_fill`) and a
release-constrained LPT (:func:`llm_sets_lpt`); plus the joint first-fit
fallback (E_j == L_j) used when deferral cannot meet the cap or budget.
"""

from __future__ import annotations

import numpy as np

from .. import compiled
from ..errors import InvalidInput
from .common import Candidate, Replicas, slot_sums

__all__ = [
    "llm_sets_fill",
    "llm_sets_lpt",
    "ffd_joint",
    "fits_cap",
    "fits_patches",
    "repair_joint",
]


def llm_sets_fill(
    rp: Replicas, eidx: np.ndarray, tol: float, profile: np.ndarray | None = None
) -> Candidate:
    """LLM sets by a running target: microbatch j takes, from the samples encoded so far,
    about ``remaining / (m - j)`` of the LLM work (largest first, under the token cap), or
    with ``profile`` [R, m] its share ``remaining * p_j / (p_j + ... + p_{m-1})``."""
    has_enc, valid, llm, tok = rp.has_enc, rp.valid, rp.llm, rp.tok
    m, cap, budget = rp.m, rp.cap, rp.budget
    r_count, n = llm.shape
    rows = np.arange(r_count)
    big = np.iinfo(np.int64).max // 4
    cap_v = big if cap is None else cap
    prof = np.ones((r_count, m)) if profile is None else np.asarray(profile, np.float64)
    # what is left of the profile from j on (both paths divide by these same sums), each
    # added from p_j up, in m array additions
    tail = np.zeros((r_count, m))
    for k in range(m):
        tail[:, : k + 1] += prof[:, k : k + 1]
    if compiled.enabled() and n > 0:
        from . import sets_kernel  # numba is imported with it

        lidx, failed = sets_kernel.fill_sets(
            eidx, has_enc, valid, llm, tok.astype(np.int64), prof, tail, m, tol, cap_v,
            budget is not None, 0 if budget is None else budget,
        )  # fmt: skip
        return Candidate(eidx, lidx, failed)
    lidx = np.full((r_count, n), -1, dtype=np.int64)
    consumed = ~valid
    failed = np.zeros(r_count, bool)
    for j in range(m):
        avail = ~consumed & ((eidx <= j) | ~has_enc)
        # a sequential sum (cumsum), as the compiled twin's: pairwise sums round otherwise
        remaining = np.cumsum(np.where(consumed, 0.0, llm), axis=1)[:, -1]
        if j == m - 1:
            take = avail.copy()
            ntok = np.where(take, tok, 0).sum(axis=1)
            failed |= ntok > cap_v
            failed |= (~consumed & ~take).any(axis=1)
        else:
            target = remaining * prof[:, j] / tail[:, j]
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
    return Candidate(eidx, lidx, failed)


def llm_sets_lpt(rp: Replicas, eidx: np.ndarray) -> Candidate:
    """LLM microbatch of every member ([R, n]) by release-constrained LPT.

    Largest LLM work first, each sample goes to the least LLM-loaded microbatch
    j >= its encoder microbatch (its release) such that the token cap holds in
    j and the deferral buffer stays within budget at every boundary it waits
    across. Text-only samples are released at 0 (they are encoded where
    consumed). Rows where some sample fits nowhere are reported failed.
    """
    has_enc, valid, llm, tok = rp.has_enc, rp.valid, rp.llm, rp.tok
    m, cap, budget = rp.m, rp.cap, rp.budget
    r_count, n = llm.shape
    rows = np.arange(r_count)
    big = np.iinfo(np.int64).max // 4
    cap_v = big if cap is None else cap
    bud_v = big if budget is None else budget
    release = np.where(has_enc, eidx, 0)
    order = np.argsort(-np.where(valid, llm, -np.inf), axis=1, kind="stable")
    if compiled.enabled():
        from . import sets_kernel  # numba is imported with it

        lidx, failed = sets_kernel.lpt_sets(
            eidx, has_enc, valid, llm, tok.astype(np.int64), order, m, cap_v, bud_v
        )
        return Candidate(eidx, lidx, failed)
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
    return Candidate(eidx, lidx, failed)


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
    cum_c = np.cumsum(c_s, 1)
    ok = a_s & (cum_c <= limit[:, None]) & (np.cumsum(t_s, 1) <= cap)
    length = np.where(ok.all(axis=1), n, np.argmin(ok, axis=1))
    length = np.where(a_s[:, 0] & (length == 0), 1, length)
    take_s = np.arange(n)[None, :] < length[:, None]
    take = np.zeros_like(avail)
    np.put_along_axis(take, order, take_s, axis=1)
    last = np.maximum(length - 1, 0)[:, None]  # the prefix's sum, sequential (see above)
    load = np.where(length > 0, np.take_along_axis(cum_c, last, 1)[:, 0], 0.0)
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


def ffd_joint(
    cost: np.ndarray,
    tok: np.ndarray,
    m: int,
    cap: int | None,
    where: str,
    patches: np.ndarray | None = None,
    patch_cap: np.ndarray | None = None,
) -> np.ndarray:
    """Bins for one replica with E == L: least-loaded-that-fits, largest first, under the
    token ``cap`` and (``patches`` [n, E]) the per-encoder ``patch_cap``."""
    n = len(cost)
    order = np.argsort(-cost, kind="stable")
    loads = np.zeros(m)
    toks = np.zeros(m, dtype=np.int64)
    pcap = patch_cap if patches is not None else None
    pl = np.zeros((m, 0 if pcap is None else len(pcap)), dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for i in order:
        fits = np.ones(m, bool) if cap is None else toks + tok[i] <= cap
        if pcap is not None:
            fits &= (pl + patches[i] <= pcap).all(axis=1)
        if not fits.any():
            packed = _first_fit_by_size(tok, m, cap, patches, pcap)
            if packed is not None:  # balance gives way to the caps: a packing exists
                return packed
            what = f"max_tokens={cap}" if cap is not None else ""
            if pcap is not None:
                what += f"{' and ' if what else ''}max_encoder_patches={pcap.tolist()}"
            raise InvalidInput(
                f"{where}: cannot pack {n} samples into {m} microbatches under {what} "
                f"(sample {int(i)} does not fit); raise the cap or microbatches"
            )
        j = int(np.argmin(np.where(fits, loads, np.inf)))
        out[i] = j
        loads[j] += cost[i]
        toks[j] += tok[i]
        if pcap is not None:
            pl[j] += patches[i]
    return out


def _first_fit_by_size(
    tok: np.ndarray,
    m: int,
    cap: int | None,
    patches: np.ndarray | None,
    pcap: np.ndarray | None,
) -> np.ndarray | None:
    """Sets by first fit, largest first by size against the caps (not by cost): where the
    cost-balanced packing cannot place a sample this still finds one if first-fit-decreasing
    can; ``None`` if not."""
    parts = [] if cap is None else [tok[:, None] / max(cap, 1)]
    if pcap is not None:
        parts.append(patches / np.maximum(pcap, 1)[None, :])
    size = np.concatenate(parts, axis=1) if parts else np.zeros((len(tok), 1))
    loads = np.zeros((m, size.shape[1]))
    out = np.empty(len(tok), dtype=np.int64)
    for i in np.argsort(-size.max(axis=1), kind="stable"):
        fits = (loads + size[i] <= 1.0 + 1e-9).all(axis=1)
        if not fits.any():
            return None
        j = int(np.argmax(fits))
        out[i] = j
        loads[j] += size[i]
    return out


def repair_joint(
    rp: Replicas, bins: np.ndarray, w: np.ndarray, weight: np.ndarray | None = None
) -> np.ndarray:
    """[R, n] joint sets ``bins`` (E == L) with every set above the token or patch cap
    repaired where exchanges can: the fullest set gives a sample to another set for one
    that takes less of the caps (or just gives it, where that set has room), the exchange
    that moves the least work per overflow it removes (the squared work gap of its two
    samples over the squared overflow removed; work is ``w`` [R, n, D], the columns the
    sets were balanced on, each over its per-set mean, counted ``weight`` [D] times), until
    every set fits or no exchange helps. Ranked by the gap alone, the exchanges removed
    slivers: a set one small sample over the cap traded it for one a little smaller, again
    and again (28 exchanges a replica on ``qwen2vl-dynamic``'s co-shaped sets at 8192 /
    dp 128, 6 by this ratio; an assignment 3 ms faster, the landings ``max_delay=2``
    prices at 4096 / dp 16 / 32 2-3x faster).

    Balanced joint sets weigh tokens as one column among several, so a replica holding the
    batch's longest documents can end one set above the cap while others have room: the
    whole candidate was lost on that replica, which then ran a deferring candidate or the
    FFD fallback (text-heavy with 1280-token images at 512 / dp 4 / 32: 1.031 -> 1.138 of the
    best keeping peer with the repair). Replicas whose sets fit are untouched. With numba the
    exchange loop runs compiled (:func:`.sets_kernel.repair_rows`, the same sets): a replica
    far above the caps takes hundreds of exchanges, each a few numpy calls (the landings
    ``max_delay`` prices, heavy samples twice over, took 7-10 s at 4096 / dp 16 / 32)."""
    ok = fits_cap(rp, bins)
    if ok.all():
        return bins
    m = rp.m
    sizes = [rp.tok[..., None]]
    limits = [np.iinfo(np.int64).max // 4 if rp.cap is None else int(rp.cap)]
    if rp.patch_cap is not None:
        sizes.append(np.where(rp.has_enc[..., None], rp.patches, 0))
        limits += [int(c) for c in rp.patch_cap]
    size = np.concatenate(sizes, axis=2).astype(np.int64)  # [R, n, C]
    limit = np.array(limits, dtype=np.int64)
    target = np.where(rp.valid[..., None], w, 0.0).sum(axis=1) / m  # [R, D]
    wn = w / np.where(target > 0, target, 1.0)[:, None, :]
    if weight is not None:
        wn = wn * np.sqrt(np.asarray(weight, dtype=np.float64))
    out = bins.copy()
    wn = np.ascontiguousarray(wn)
    if compiled.enabled():
        from . import sets_kernel  # numba is imported with it

        sets_kernel.repair_rows(out, rp.valid, size, limit, wn, np.flatnonzero(~ok), m)
        return out
    for r in np.flatnonzero(~ok):
        v = np.flatnonzero(rp.valid[r])
        b, sz, x = out[r, v], size[r, v], wn[r, v]
        load = np.zeros((m, size.shape[2]), dtype=np.int64)
        np.add.at(load, b, sz)
        for _ in range(4 * len(v)):  # each exchange lowers the total overflow
            over = _column_sum(np.maximum(load - limit, 0) / limit)
            h = int(np.argmax(over))
            if over[h] <= 0:
                break
            give = np.flatnonzero(b == h)
            take = np.flatnonzero(b != h)
            if len(give) < 2:
                break  # one sample alone above a cap: validation names it
            # exchange give[i] for take[k], or (the extra last column) give it alone to the
            # set with the most room left
            room = ((limit - load) / limit).min(axis=1)
            room[h] = -np.inf
            dest = np.append(b[take], int(np.argmax(room)))
            back = np.concatenate([sz[take], np.zeros((1, sz.shape[1]), np.int64)])[None]
            new_h = load[h] - sz[give][:, None] + back  # [give, take + 1, C]
            new_j = load[dest][None] + sz[give][:, None] - back
            new_over = _column_sum(np.maximum(new_h - limit, 0) / limit)
            good = (new_over < over[h] - 1e-12) & (new_j <= limit).all(axis=2)
            gap = np.concatenate([x[take], np.zeros((1, x.shape[1]))])[None] - x[give][:, None]
            # work moved per overflow removed, squared (scale-free: one exchange that removes
            # the overflow beats a chain of near-equal ones, each removing a sliver)
            gain = np.where(good, over[h] - new_over, 1.0)
            cost = np.where(good, _column_sum(gap**2) / (gain * gain), np.inf)
            i, k = np.unravel_index(int(np.argmin(cost)), cost.shape)
            if not np.isfinite(cost[i, k]):
                break
            a = give[i]
            j = int(dest[k])
            load[h] -= sz[a]
            load[j] += sz[a]
            b[a] = j
            if k < len(take):
                c = take[k]
                load[j] -= sz[c]
                load[h] += sz[c]
                b[c] = h
        out[r, v] = b
    return out


def _column_sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis, column after column (the compiled twin's order)."""
    total = a[..., 0].copy()
    for c in range(1, a.shape[-1]):
        total += a[..., c]
    return total


def fits_cap(rp: Replicas, bins: np.ndarray) -> np.ndarray:
    """[R] whether joint sets ``bins`` (E == L) keep every set within the token cap and the
    patch cap."""
    return fits_tokens(rp, bins) & fits_patches(rp, bins)


def fits_tokens(rp: Replicas, lidx: np.ndarray) -> np.ndarray:
    """[R] whether every LLM set ``lidx`` stays within the token cap."""
    if rp.cap is None:
        return np.ones(rp.llm.shape[0], bool)
    return (slot_sums(lidx, rp.tok.astype(np.float64), rp.valid, rp.m) <= rp.cap).all(axis=1)


def empty_llm_set(lidx: np.ndarray, valid: np.ndarray, m: int) -> np.ndarray:
    """[R] whether a replica with at least m samples leaves an LLM set empty."""
    counts = slot_sums(lidx, np.ones(lidx.shape), valid & (lidx >= 0), m)
    return (counts < 0.5).any(axis=1) & (valid.sum(axis=1) >= m)


def fits_patches(rp: Replicas, eidx: np.ndarray) -> np.ndarray:
    """[R] whether every encoder set ``eidx`` stays within the per-encoder patch cap."""
    if rp.patch_cap is None:
        return np.ones(rp.llm.shape[0], bool)
    got = slot_sums(eidx, rp.patches.astype(np.float64), rp.valid & rp.has_enc, rp.m)
    return (got <= rp.patch_cap[None, None, :] + 0.5).all(axis=(1, 2))
