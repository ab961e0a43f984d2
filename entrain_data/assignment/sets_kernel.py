"""Compiled twins of the level-2 set builders (numba, when installed; see :mod:`entrain_data.compiled`).

Each function here returns exactly what its numpy original returns, row by row:
:func:`fill_sets` is :func:`.llm_sets.llm_sets_fill`, :func:`lpt_sets` is
:func:`.llm_sets.llm_sets_lpt`, :func:`lpt_items` and :func:`vector_lpt` are the
item-by-item branches of :func:`.encoder_sets.lpt_bins` and :func:`.encoder_sets.vector_bins`,
:func:`refine_vector_rows` the loop of :func:`.encoder_sets.refine_vector`,
:func:`refine_bins_rows` that of :func:`.encoder_sets.refine_bins`, :func:`repair_rows` the exchange loop of :func:`.llm_sets.repair_joint`, :func:`slot_sums_rows`
:func:`.common.slot_sums`. The numpy versions loop over microbatches or items
with one array operation per step over every replica; here each replica runs its own
loop. Float sums are sequential on both sides (the numpy code sums with ``cumsum``
where an order matters), ties go to the first index as ``argmin``/``argmax`` and the
stable sorts give them.
"""

from __future__ import annotations

import numpy as np

from ..compiled import jit

__all__ = [
    "fill_sets",
    "lpt_sets",
    "lpt_items",
    "vector_lpt",
    "refine_vector_rows",
    "refine_bins_rows",
    "repair_rows",
    "slot_sums_rows",
]


@jit
def _fill_row(avail, cost, tok, order, limit, cap, take, fills):
    """One row of :func:`.llm_sets._fill`: marks ``take``, returns the tokens taken.
    ``order``: every item by descending cost, ties by index (a stable argsort of
    ``-cost``); the available ones in it are the numpy code's sorted candidates."""
    n = cost.shape[0]
    for i in range(n):
        take[i] = False
    cum_c = 0.0
    cum_t = 0
    load = 0.0
    ntok = 0
    taken = 0
    first = -1
    for k in range(n):
        i = order[k]
        if not avail[i]:
            continue
        if first < 0:
            first = i
        cum_c += cost[i]
        cum_t += tok[i]
        if not (cum_c <= limit and cum_t <= cap):
            break
        take[i] = True
        taken += 1
        ntok += tok[i]
        load = cum_c
    if taken == 0 and first >= 0:  # the largest alone, whatever its size
        take[first] = True
        load = cost[first]
        ntok = tok[first]
    for _ in range(fills):
        best = -1
        best_c = -1.0
        for i in range(n):
            fits = cost[i] <= limit - load and tok[i] <= cap - ntok
            if avail[i] and not take[i] and fits and cost[i] > best_c:  # first largest
                best, best_c = i, cost[i]
        if best < 0:
            break
        take[best] = True
        load += cost[best]
        ntok += tok[best]
    return ntok


@jit
def fill_sets(eidx, has_enc, valid, llm, tok, prof, tail, m, tol, cap, use_budget, budget):
    """[R, n] LLM microbatch and [R] failed of :func:`.llm_sets.llm_sets_fill`."""
    r_count, n = llm.shape
    lidx = np.full((r_count, n), -1, np.int64)
    failed = np.zeros(r_count, np.bool_)
    consumed = np.empty(n, np.bool_)
    avail = np.empty(n, np.bool_)
    take = np.empty(n, np.bool_)
    okey = np.empty(n, np.int64)
    big = np.iinfo(np.int64).max // 4
    for r in range(r_count):
        by_cost = np.argsort(-llm[r], kind="mergesort")
        for i in range(n):
            consumed[i] = not valid[r, i]
        for j in range(m):
            remaining = 0.0
            for i in range(n):
                avail[i] = not consumed[i] and (eidx[r, i] <= j or not has_enc[r, i])
                remaining += 0.0 if consumed[i] else llm[r, i]
            if j == m - 1:
                ntok = 0
                for i in range(n):
                    take[i] = avail[i]
                    if avail[i]:
                        ntok += tok[r, i]
                    elif not consumed[i]:
                        failed[r] = True
                if ntok > cap:
                    failed[r] = True
            else:
                target = remaining * prof[r, j] / tail[r, j]
                ntok = _fill_row(avail, llm[r], tok[r], by_cost, target * (1 + tol), cap, take, 3)
                if use_budget:
                    buffered = 0
                    for i in range(n):
                        w = has_enc[r, i] and eidx[r, i] <= j and not consumed[i] and not take[i]
                        okey[i] = eidx[r, i] * (n + 1) + i if w else big
                        if w:
                            buffered += tok[r, i]
                    if buffered > budget:  # consume the oldest waiting samples first
                        order = np.argsort(okey, kind="mergesort")
                        for k in range(n):
                            i = order[k]
                            if okey[i] == big or buffered <= budget:
                                break
                            if ntok + tok[r, i] <= cap:
                                take[i] = True
                                ntok += tok[r, i]
                                buffered -= tok[r, i]
                        if buffered > budget:
                            failed[r] = True
            for i in range(n):
                if take[i]:
                    lidx[r, i] = j
                    consumed[i] = True
    return lidx, failed


@jit
def lpt_sets(eidx, has_enc, valid, llm, tok, order, m, cap, budget):
    """[R, n] LLM microbatch and [R] failed of :func:`.llm_sets.llm_sets_lpt`."""
    r_count, n = llm.shape
    lidx = np.full((r_count, n), -1, np.int64)
    failed = np.zeros(r_count, np.bool_)
    loads = np.empty(m)
    toks = np.empty(m, np.int64)
    buffered = np.empty(m, np.int64)
    for r in range(r_count):
        loads[:] = 0.0
        toks[:] = 0
        buffered[:] = 0
        for t in range(n):
            item = order[r, t]
            if not valid[r, item]:
                break  # invalid members sort last
            he = has_enc[r, item]
            rel = eidx[r, item] if he else 0
            tk = tok[r, item]
            best = -1
            best_v = np.inf
            reach = True
            for j in range(m):
                if j > 0:  # every boundary rel..j-1 can hold the sample while it waits
                    jb = j - 1
                    reach = reach and (buffered[jb] + tk <= budget or jb < rel or not he)
                if j >= rel and reach and toks[j] + tk <= cap:
                    v = loads[j] + 1e-12 * toks[j]
                    if v < best_v:
                        best, best_v = j, v
            if best < 0:
                failed[r] = True
                continue
            lidx[r, item] = best
            loads[best] += llm[r, item]
            toks[best] += tk
            if he:
                for jb in range(rel, best):
                    buffered[jb] += tk
    return lidx, failed


@jit
def lpt_items(cost, order, valid, m):
    """[R, n] bin ids of :func:`.encoder_sets.lpt_bins` placing item by item."""
    r_count, n = cost.shape
    bins = np.full((r_count, n), -1, np.int64)
    loads = np.empty(m)
    counts = np.empty(m)
    for r in range(r_count):
        loads[:] = 0.0
        counts[:] = 0.0
        for t in range(n):
            item = order[r, t]
            if not valid[r, item]:
                break  # invalid members sort last
            best = 0
            best_v = loads[0] + counts[0] * 1e-12
            for j in range(1, m):
                v = loads[j] + counts[j] * 1e-12
                if v < best_v:  # the lightest bin; among equal the first, as a stable sort
                    best, best_v = j, v
            bins[r, item] = best
            loads[best] += cost[r, item]
            counts[best] += 1.0
    return bins


@jit
def vector_lpt(wn, order, valid, m, weight):
    """[R, n] bin ids of :func:`.encoder_sets.vector_bins` placing item by item."""
    r_count, n, d = wn.shape
    bins = np.full((r_count, n), -1, np.int64)
    loads = np.empty((m, d))
    counts = np.empty(m)
    for r in range(r_count):
        loads[:, :] = 0.0
        counts[:] = 0.0
        for t in range(n):
            item = order[r, t]
            if not valid[r, item]:
                break  # invalid members sort last
            best = -1
            best_v = np.inf
            for j in range(m):
                after = loads[j, 0] + wn[r, item, 0]
                total = loads[j, 0] * weight[0]
                for q in range(1, d):
                    after = max(after, loads[j, q] + wn[r, item, q])
                    total += loads[j, q] * weight[q]
                v = after + 1e-9 * total + 1e-12 * counts[j]
                if v < best_v:
                    best, best_v = j, v
            bins[r, item] = best
            for q in range(d):
                loads[best, q] += wn[r, item, q]
            counts[best] += 1.0
    return bins


@jit
def _sort_by_key(items, keys, count):
    """Sort ``items[:count]`` (and ``keys[:count]`` with them) by ascending key, ties kept in
    their order, as a stable argsort does; insertion sort where few (no allocation)."""
    if count > 64:
        order = np.argsort(keys[:count], kind="mergesort")
        sorted_items = items[:count][order]
        sorted_keys = keys[:count][order]
        items[:count] = sorted_items
        keys[:count] = sorted_keys
        return
    for i in range(1, count):
        it = items[i]
        ky = keys[i]
        j = i - 1
        while j >= 0 and keys[j] > ky:
            items[j + 1] = items[j]
            keys[j + 1] = keys[j]
            j -= 1
        items[j + 1] = it
        keys[j + 1] = ky


@jit
def _leave(mem, cnt, j, item):
    """Remove ``item`` from bin ``j``'s ascending member list."""
    k = 0
    while mem[j, k] != item:
        k += 1
    for t in range(k, cnt[j] - 1):
        mem[j, t] = mem[j, t + 1]
    cnt[j] -= 1


@jit
def _join(mem, cnt, j, item):
    """Insert ``item`` into bin ``j``'s ascending member list."""
    k = cnt[j]
    while k > 0 and mem[j, k - 1] > item:
        mem[j, k] = mem[j, k - 1]
        k -= 1
    mem[j, k] = item
    cnt[j] += 1


@jit
def _project(members, count, wn, u, sign, items, keys):
    """``items[:count]`` the bin's ``members`` (ascending), ``keys`` their projections
    on ``u`` times ``sign``."""
    d = u.shape[0]
    for t in range(count):
        i = members[t]
        acc = wn[i, 0] * u[0]
        for q in range(1, d):
            acc = acc + wn[i, q] * u[q]
        items[t] = i
        keys[t] = sign * acc


@jit
def refine_vector_rows(slot, wn, dev, m, iters, pair_items):
    """The loop of :func:`.encoder_sets.refine_vector`, row by row; updates ``slot`` and
    ``dev`` in place. Each bin's members are kept in an ascending list (their count is
    the bin's size), so a pair reads its two bins' items, not the row's."""
    r_count, n, d = wn.shape
    mem = np.empty((m, n), np.int64)
    cnt = np.zeros(m, np.int64)
    obj = np.empty(m)
    opp = np.empty(m)
    new_h = np.empty(d)
    new_b = np.empty(d)
    ih = np.empty(n, np.int64)
    ib = np.empty(n, np.int64)
    key_h = np.empty(n)
    key_b = np.empty(n)
    u = np.empty(d)
    by_opp = np.empty(m, np.int64)
    for r in range(r_count):
        cnt[:] = 0
        for i in range(n):
            j = slot[r, i]
            if j < m:  # slot m holds the padding
                mem[j, cnt[j]] = i
                cnt[j] += 1
        tries = 0
        h = 0
        for _ in range(iters):
            if tries >= m - 1:
                break
            if tries == 0:  # the bins changed (or a new row): the worst bin and its opposites
                for j in range(m):
                    acc = dev[r, j, 0] * dev[r, j, 0]
                    for q in range(1, d):
                        acc = acc + dev[r, j, q] * dev[r, j, q]
                    obj[j] = acc
                h = 0
                for j in range(1, m):
                    if obj[j] > obj[h]:
                        h = j
                for j in range(m):
                    acc = dev[r, j, 0] * dev[r, h, 0]
                    for q in range(1, d):
                        acc = acc + dev[r, j, q] * dev[r, h, q]
                    opp[j] = acc
                opp[h] = np.inf
                b = 0
                for j in range(1, m):
                    if opp[j] < opp[b]:
                        b = j
            else:  # a pair that did not help changes nothing: the next most opposed bin
                if tries == 1:
                    by_opp[:] = np.argsort(opp, kind="mergesort")
                b = by_opp[min(tries, m - 2)]
            for q in range(d):
                u[q] = dev[r, h, q] - dev[r, b, q]
            nh = cnt[h]
            nb = cnt[b]
            _project(mem[h], nh, wn[r], u, -1.0, ih, key_h)
            _project(mem[b], nb, wn[r], u, 1.0, ib, key_b)
            # the items whose leaving helps most first (stable: ties by index), at most pair_items
            _sort_by_key(ih, key_h, nh)
            _sort_by_key(ib, key_b, nb)
            nh = min(nh, pair_items)
            nb = min(nb, pair_items)
            best = np.inf
            bx = -1
            by = -1
            for x in range(nh + 1):
                for y in range(nb + 1):
                    if x == 0 and y == 0:
                        continue
                    if y == 0 and cnt[h] <= 1:
                        continue
                    if x == 0 and cnt[b] <= 1:
                        continue
                    acc_h = 0.0
                    acc_b = 0.0
                    for q in range(d):
                        xq = wn[r, ih[x - 1], q] if x > 0 else 0.0
                        yq = wn[r, ib[y - 1], q] if y > 0 else 0.0
                        vh = dev[r, h, q] - xq + yq
                        vb = dev[r, b, q] + xq - yq
                        if q == 0:
                            acc_h = vh * vh
                            acc_b = vb * vb
                        else:
                            acc_h = acc_h + vh * vh
                            acc_b = acc_b + vb * vb
                    v = acc_h + acc_b
                    if v < best:
                        best, bx, by = v, x, y
            old = obj[h] + obj[b]
            if not (best < old * (1 - 1e-9) - 1e-12):
                tries += 1
                continue
            tries = 0
            for q in range(d):
                xq = wn[r, ih[bx - 1], q] if bx > 0 else 0.0
                yq = wn[r, ib[by - 1], q] if by > 0 else 0.0
                new_h[q] = dev[r, h, q] - xq + yq
                new_b[q] = dev[r, b, q] + xq - yq
            for q in range(d):
                dev[r, h, q] = new_h[q]
                dev[r, b, q] = new_b[q]
            if bx > 0:
                slot[r, ih[bx - 1]] = b
                _leave(mem, cnt, h, ih[bx - 1])
                _join(mem, cnt, b, ih[bx - 1])
            if by > 0:
                slot[r, ib[by - 1]] = h
                _leave(mem, cnt, b, ib[by - 1])
                _join(mem, cnt, h, ib[by - 1])


@jit
def slot_sums_rows(idx, values, valid, m):
    """[R, m, K] sums of ``values`` [R, n, K] over each slot's members, in member order (the
    order ``bincount`` adds them in :func:`.common.slot_sums`)."""
    r_count, n, k = values.shape
    out = np.zeros((r_count, m, k))
    for r in range(r_count):
        for i in range(n):
            if valid[r, i]:
                j = idx[r, i]
                for c in range(k):
                    out[r, j, c] += values[r, i, c]
    return out


@jit
def repair_rows(out, valid, size, limit, wn, rows, m):
    """The exchange loop of :func:`.llm_sets.repair_joint` on replicas ``rows``; updates
    ``out`` [R, n] in place. Sums over the cap and work columns run in column order, as
    the numpy code's do."""
    n_cap = size.shape[2]
    d = wn.shape[2]
    over = np.empty(m)
    room = np.empty(m)
    for r in rows:
        v = np.flatnonzero(valid[r])
        nv = len(v)
        b = out[r][v]
        sz = size[r][v]
        x = wn[r][v]
        load = np.zeros((m, n_cap), np.int64)
        for i in range(nv):
            for c in range(n_cap):
                load[b[i], c] += sz[i, c]
        give = np.empty(nv, np.int64)
        take = np.empty(nv, np.int64)
        for _ in range(4 * nv):  # each exchange lowers the total overflow
            for j in range(m):
                s = max(load[j, 0] - limit[0], 0) / limit[0]
                low = (limit[0] - load[j, 0]) / limit[0]
                for c in range(1, n_cap):
                    s += max(load[j, c] - limit[c], 0) / limit[c]
                    low = min(low, (limit[c] - load[j, c]) / limit[c])
                over[j] = s
                room[j] = low
            h = np.argmax(over)
            if over[h] <= 0:
                break
            ng = 0
            nt = 0
            for i in range(nv):
                if b[i] == h:
                    give[ng] = i
                    ng += 1
                else:
                    take[nt] = i
                    nt += 1
            if ng < 2:
                break  # one sample alone above a cap: validation names it
            room[h] = -np.inf
            spare = np.argmax(room)  # where a sample given alone goes
            best = np.inf
            bi = -1
            bk = -1
            for gi in range(ng):
                a = give[gi]
                for k in range(nt + 1):
                    alone = k == nt
                    c_ = 0 if alone else take[k]
                    dest = spare if alone else b[c_]
                    back0 = 0 if alone else sz[c_, 0]
                    new_over = max(load[h, 0] - sz[a, 0] + back0 - limit[0], 0) / limit[0]
                    fits = load[dest, 0] + sz[a, 0] - back0 <= limit[0]
                    for c in range(1, n_cap):
                        back = 0 if alone else sz[c_, c]
                        new_over += max(load[h, c] - sz[a, c] + back - limit[c], 0) / limit[c]
                        fits = fits and load[dest, c] + sz[a, c] - back <= limit[c]
                    if not (new_over < over[h] - 1e-12 and fits):
                        continue
                    g = (0.0 if alone else x[c_, 0]) - x[a, 0]
                    cost = g * g
                    for q in range(1, d):
                        g = (0.0 if alone else x[c_, q]) - x[a, q]
                        cost += g * g
                    gain = over[h] - new_over
                    cost = cost / (gain * gain)
                    if cost < best:
                        best = cost
                        bi = gi
                        bk = k
            if bi < 0:
                break
            a = give[bi]
            j = spare if bk == nt else b[take[bk]]
            for c in range(n_cap):
                load[h, c] -= sz[a, c]
                load[j, c] += sz[a, c]
            b[a] = j
            if bk < nt:
                c_ = take[bk]
                for c in range(n_cap):
                    load[j, c] -= sz[c_, c]
                    load[h, c] += sz[c_, c]
                b[c_] = h
        for i in range(nv):
            out[r, v[i]] = b[i]


@jit
def refine_bins_rows(slot, c, m, iters, span):
    """The loop of :func:`.encoder_sets.refine_bins`, row by row; updates ``slot`` in place.
    A row stops where its step finds no better exchange (the numpy code's rows stay as they
    are from then on). The light bin's costs, with a 0 (a move) in front, are searched for
    each heavy item's ideal partner with the numpy code's offsets (``r * span``) and
    comparisons, so the same two neighbours are tried."""
    r_count, n = slot.shape
    loads = np.empty(m + 1)
    heavy = np.empty(n, np.int64)
    light = np.empty(n, np.int64)
    fl = np.empty(n + 1)
    for r in range(r_count):
        by_cost = np.argsort(c[r], kind="mergesort")  # ascending, ties by index
        off = r * span
        for _ in range(iters):
            loads[:] = 0.0
            for i in range(n):
                loads[slot[r, i]] += c[r, i]
            h = 0
            lo = 0
            for j in range(1, m):
                if loads[j] > loads[h]:
                    h = j
                if loads[j] < loads[lo]:
                    lo = j
            gap = loads[h] - loads[lo]
            nh = 0
            nl = 0
            for t in range(n):
                i = by_cost[t]
                if slot[r, i] == h:
                    heavy[nh] = i
                    nh += 1
                elif slot[r, i] == lo:
                    light[nl] = i
                    nl += 1
            fl[0] = 0.0 + off
            for j in range(nl):
                fl[j + 1] = c[r, light[j]] + off
            best_gap = np.inf
            best_a = 0
            best_b = 0
            for side in range(2):  # the neighbour below the ideal partner, then above
                pass_g = np.inf
                pass_a = 0
                pass_p = 0
                for a in range(nh):
                    ch = c[r, heavy[a]]
                    want = ch - gap / 2 + off
                    lo_i = 0  # searchsorted (left) over fl[0 .. nl]
                    hi_i = nl + 1
                    while lo_i < hi_i:
                        mid = (lo_i + hi_i) >> 1
                        if fl[mid] < want:
                            lo_i = mid + 1
                        else:
                            hi_i = mid
                    p = max(lo_i - 1 + side, 0)
                    if p > nl:
                        continue  # past the light bin's items (a pad in the numpy code)
                    cand = 0.0 if p == 0 else c[r, light[p - 1]]
                    ng = abs(gap - 2 * (ch - cand))
                    if ng < pass_g:
                        pass_g = ng
                        pass_a = a
                        pass_p = p
                if pass_g < best_gap:
                    best_gap = pass_g
                    best_a = pass_a
                    best_b = pass_p
            if not (best_gap < gap - 1e-12 * max(gap, 1.0)):
                break
            slot[r, heavy[best_a]] = lo
            if best_b > 0:
                slot[r, light[best_b - 1]] = h
