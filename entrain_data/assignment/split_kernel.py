"""Compiled twins of level 1's refinement and of the cap packing check (numba, when installed).

:func:`refine_pairs` is :func:`.replica_split._refine_pairs`, :func:`refine_replicas`
:func:`.replica_split._refine_replicas`, :func:`polish_modules`
:func:`.replica_split._polish_modules`, :func:`packs` :func:`.replica_split._packs`.
The numpy versions spend their time in numpy's per-call cost over [dp, C, C] arrays a few
hundred elements wide (about 15 ms an assignment at 8192 / dp 128); here every pair of
replicas, every candidate swap, runs as one loop. Results are identical, not close: every
value is computed by the same float operations in the same order (sums over modules are
sequential on both sides), ties go to the first index as ``argmin``/``argmax`` and the
stable sorts give them. ``tests/test_compiled.py`` compares the two paths.
"""

from __future__ import annotations

import numpy as np

from ..compiled import jit

__all__ = ["greedy_rounds", "packs", "polish_modules", "refine_pairs", "refine_replicas"]


@jit
def greedy_rounds(order, wp, members, loads, rounds):
    """The first ``rounds`` columns of ``members`` [dp, n]: round k gives the k-th ``dp`` items
    of ``order`` (-1: a pad, ``wp``'s last row) to the replicas lightest first (by the
    sequential sum of ``loads`` [dp, D], ties by index), ``loads`` updated in place."""
    dp, d = loads.shape
    total = np.empty(dp)
    pad = wp.shape[0] - 1
    for k in range(rounds):
        for r in range(dp):
            acc = loads[r, 0]
            for q in range(1, d):
                acc = acc + loads[r, q]
            total[r] = acc
        lightest = np.argsort(total, kind="mergesort")
        for t in range(dp):
            r = lightest[t]
            item = order[k * dp + t]
            members[r, k] = item
            row = item if item >= 0 else pad
            for q in range(d):
                loads[r, q] += wp[row, q]


@jit
def _relative(loads, mean, scale, rel, obj):
    """rel = (loads - mean) / scale and each replica's largest |rel| into ``obj``."""
    dp, d = loads.shape
    for r in range(dp):
        worst = 0.0
        for k in range(d):
            v = (loads[r, k] - mean[k]) / scale[k]
            rel[r, k] = v
            worst = max(worst, abs(v))
        obj[r] = worst


@jit
def _swap(members, loads, wp, a, ca, b, cb):
    """Exchange member ``ca`` of replica ``a`` with member ``cb`` of ``b``, loads updated
    as the numpy code does (the difference subtracted from one, added to the other)."""
    ma, mb = members[a, ca], members[b, cb]
    for k in range(loads.shape[1]):
        dl = wp[ma, k] - wp[mb, k]
        loads[a, k] -= dl
        loads[b, k] += dl
    members[a, ca], members[b, cb] = mb, ma


@jit
def refine_pairs(members, loads, wp, mean, scale, base, iters, good_enough):
    """:func:`.replica_split._refine_pairs`'s rounds: ``members`` and ``loads`` in place."""
    dp, n = members.shape
    d = loads.shape[1]
    c = base.shape[0]
    half = dp // 2
    rel = np.empty((dp, d))
    obj = np.empty(dp)
    key = np.empty(dp)
    cols = np.empty(c, np.int64)
    wn = np.empty((wp.shape[0], d))  # on the relative scale once: the quotients numpy takes
    for i in range(wp.shape[0]):
        for k in range(d):
            wn[i, k] = wp[i, k] / scale[k]
    for it in range(iters):
        _relative(loads, mean, scale, rel, obj)
        if obj.max() < good_enough:
            break
        for r in range(dp):
            if it % (d + 1) < d:
                key[r] = -rel[r, it % d]
            else:
                s = rel[r, 0]
                for k in range(1, d):
                    s += rel[r, k]
                key[r] = -s
        order = np.argsort(key, kind="mergesort")
        for j in range(c):
            cols[j] = (base[j] + it * 5) % n if c < n else base[j]
        for p in range(half):
            a, b = order[p], order[dp - 1 - p]
            best, best_v = 0, np.inf
            for x in range(c):
                ia = members[a, cols[x]]
                for y in range(c):
                    ib = members[b, cols[y]]
                    v = 0.0
                    for k in range(d):
                        dk = wn[ia, k] - wn[ib, k]
                        v = max(v, abs(rel[a, k] - dk))
                        v = max(v, abs(rel[b, k] + dk))
                    if (ia >= 0) != (ib >= 0):
                        v = np.inf  # a sample for a pad
                    if (x == 0 and y == 0) or v < best_v:
                        best, best_v = x * c + y, v
            if not best_v < max(obj[a], obj[b]) - 1e-12:
                continue
            _swap(members, loads, wp, a, cols[best // c], b, cols[best % c])


@jit
def refine_replicas(members, loads, wp, mean, scale, cols, iters, good_enough):
    """:func:`.replica_split._refine_replicas`'s loop: ``members`` and ``loads`` in place."""
    dp, _ = members.shape
    d = loads.shape[1]
    c = cols.shape[0]
    rel = np.empty((dp, d))
    obj = np.empty(dp)
    key = np.empty(dp)
    tried = np.zeros((dp, dp), np.bool_)
    for _ in range(iters):
        _relative(loads, mean, scale, rel, obj)
        a = np.argmax(obj)
        if obj[a] < good_enough:
            break
        dim = np.argmax(np.abs(rel[a]))
        sign = np.sign(rel[a, dim])
        for r in range(dp):
            key[r] = sign * rel[r, dim]
        cand = np.argsort(key, kind="mergesort")
        b = -1
        for j in range(dp):
            if cand[j] != a and not tried[a, cand[j]]:
                b = cand[j]
                break
        if b < 0:
            break
        best_x, best_y, best_v = 0, 0, np.inf
        for x in range(c):
            ia = members[a, cols[x]]
            for y in range(c):
                ib = members[b, cols[y]]
                v = 0.0
                for k in range(d):  # both replicas' largest deviation after the swap
                    delta = wp[ia, k] - wp[ib, k]
                    v = max(v, abs((loads[a, k] - delta - mean[k]) / scale[k]))
                    v = max(v, abs((loads[b, k] + delta - mean[k]) / scale[k]))
                if (ia >= 0) != (ib >= 0):
                    v = np.inf
                if (x == 0 and y == 0) or v < best_v:
                    best_x, best_y, best_v = x, y, v
        if best_v >= max(obj[a], obj[b]) - 1e-12:
            tried[a, b] = True
            continue
        tried[:, :] = False
        _swap(members, loads, wp, a, cols[best_x], b, cols[best_y])


@jit
def packs(sizes, m):
    """:func:`.replica_split._packs`: [R] whether each replica's samples fit ``m`` sets by
    first fit, largest first (``sizes`` [R, n, K], each resource over its cap)."""
    r_count, n, kk = sizes.shape
    ok = np.ones(r_count, np.bool_)
    loads = np.zeros((m, kk))
    key = np.empty(n)
    for r in range(r_count):
        for i in range(n):
            top = sizes[r, i, 0]
            for k in range(1, kk):
                top = max(top, sizes[r, i, k])
            key[i] = -top
        order = np.argsort(key, kind="mergesort")
        loads[:, :] = 0.0
        for i in range(n):
            s = sizes[r, order[i]]
            placed = False
            for j in range(m):
                fits = True
                for k in range(kk):
                    if not loads[j, k] + s[k] <= 1.0 + 1e-9:
                        fits = False
                        break
                if fits:
                    for k in range(kk):
                        loads[j, k] += s[k]
                    placed = True
                    break
            if not placed:
                ok[r] = False
                break
    return ok


@jit
def polish_modules(members, loads, wp, mean, scale, base, free, rounds, good_enough, tol):
    """:func:`.replica_split._polish_modules`'s rounds: ``members`` and ``loads`` in place."""
    dp, n = members.shape
    d = loads.shape[1]
    c = base.shape[0]
    rel = np.empty((dp, d))
    hi = np.full(d, np.inf)
    lo = np.full(d, -np.inf)
    key = np.empty(dp)
    idx = np.empty(dp, np.int64)
    nf = 0
    for r in range(dp):
        if free[r]:
            idx[nf] = r
            nf += 1
    half = nf // 2
    cols = np.empty(c, np.int64)
    wn = np.empty((wp.shape[0], d))  # the quotients numpy takes
    for i in range(wp.shape[0]):
        for q in range(d):
            wn[i, q] = wp[i, q] / scale[q]
    for it in range(rounds):
        k = it % d
        for q in range(d):
            top, bot = -np.inf, np.inf
            for r in range(dp):
                v = (loads[r, q] - mean[q]) / scale[q]
                rel[r, q] = v
                top = max(top, v)
                bot = min(bot, v)
            hi[q] = min(hi[q], top + tol)
            lo[q] = max(lo[q], bot - tol)
        for j in range(nf):
            key[j] = -rel[idx[j], k]
        order = idx[:nf][np.argsort(key[:nf], kind="mergesort")]
        if max(abs(rel[order[0], k]), abs(rel[order[nf - 1], k])) < good_enough:
            continue
        for j in range(c):
            cols[j] = (base[j] + it * 5) % n if c < n else base[j]
        for p in range(half):
            a, b = order[p], order[nf - 1 - p]  # most over with most under
            best, best_v = -1, np.inf
            for x in range(c):
                ia = members[a, cols[x]]
                for y in range(c):
                    ib = members[b, cols[y]]
                    if (ia >= 0) != (ib >= 0):
                        continue  # a sample for a pad
                    v = 0.0
                    ok = True
                    for q in range(d):
                        dq = wn[ia, q] - wn[ib, q]
                        na = rel[a, q] - dq
                        nb = rel[b, q] + dq
                        if q == k:
                            v = max(abs(na), abs(nb))
                        elif max(na, nb) > hi[q] or min(na, nb) < lo[q]:
                            ok = False
                            break
                    if ok and v < best_v:
                        best, best_v = x * c + y, v
            if best >= 0 and best_v < max(abs(rel[a, k]), abs(rel[b, k])) - 1e-12:
                _swap(members, loads, wp, a, cols[best // c], b, cols[best % c])
