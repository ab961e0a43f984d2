"""Level 1 of Entrain's assignment: the global batch split across DP replicas.

Every replica's *vector* of per-module sums (each encoder, the LLM) should
match: greedy largest-first placement in rounds, then pairwise swaps that
shrink the worst relative deviation on any module, then a polish module by module
(:func:`_polish_modules`). Counts differ by at most one.
"""

from __future__ import annotations

import numpy as np

from .. import compiled
from .common import Inputs

__all__ = ["split_replicas", "norm_columns"]

_SWAP_CANDIDATES = 64  # members considered per replica in one swap step
_GOOD_ENOUGH = 1e-5  # relative deviation of a replica's module sum below which swaps stop:
# an iteration waits for its heaviest replica, so 2e-3 (the old level) cost up to 0.2% of it
_GREEDY_ROUNDS = 64
_PAIR_ROUNDS = 24  # rounds of all-pairs swaps
_PAIR_CANDIDATES = 16  # members per replica compared in one all-pairs round  # level-1 rounds placed greedily; the rest, small items, in serpentine
_POLISH_ROUNDS = 48  # rounds of the module-by-module polish (the modules take turns)
_POLISH_TOL = 1e-4  # how far past its largest (smallest) deviation a module may move in it
_POLISH_FROM = 1e-3  # it runs only where some replica is this far off the mean on some module
_STALL_SAMPLE = 2.0  # mean microbatches of a module: a replica holding a larger sample stalls
# on it whatever its sums, and sits the polish out (stall_shed mends those after level 2)


def norm_columns(w: np.ndarray) -> np.ndarray:
    """Scale every column to mean 1 (zero columns stay zero) so modules weigh alike."""
    mean = w.mean(axis=0)
    scale = np.where(mean > 0, mean, 1.0)
    return w / scale


def split_replicas(
    w: np.ndarray,
    dp: int,
    rng: np.random.Generator,
    swap_iters: int | None = None,
    microbatches: int | None = None,
) -> np.ndarray:
    """Level 1: [dp, n] member matrix (-1 pads) with matched per-module sums.

    ``w`` is [B, D] per-sample work per module, already on a common scale.
    Counts differ by at most one between replicas. ``microbatches`` (each replica's) lets
    the polish leave out the replicas that hold a stalling sample; None: none is left out.
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
    if compiled.enabled() and d < 8:  # numpy sums under 8 columns in order, as the twin
        from .split_kernel import greedy_rounds  # numba is imported with it

        greedy_rounds(order, wp, members, loads, greedy)
    else:
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
    iters = swap_iters if swap_iters is not None else _PAIR_ROUNDS
    _refine_pairs(members, loads, wp, iters)
    if swap_iters is None:
        _refine_replicas(members, loads, wp, min(2 * dp, 16))
        _polish_modules(members, loads, wp, ~_stalling(members, wp, microbatches))
    return members


def _stalling(members: np.ndarray, wp: np.ndarray, microbatches: int | None) -> np.ndarray:
    """[dp] bool: the replica holds a sample of more than ``_STALL_SAMPLE`` mean microbatches
    on some module (``wp`` [B + 1, D], its last row the pads' zeros); none where
    ``microbatches`` is None."""
    dp = members.shape[0]
    if microbatches is None:
        return np.zeros(dp, bool)
    per_mb = wp.sum(axis=0) / (dp * microbatches)
    heavy = ((wp > _STALL_SAMPLE * per_mb) & (per_mb > 0)).any(axis=1)  # the pads' zeros: never
    return heavy[members].any(axis=1)


def _polish_modules(
    members: np.ndarray, loads: np.ndarray, wp: np.ndarray, free: np.ndarray
) -> None:
    """Swaps that even one module at a time while no other module's largest or smallest
    deviation (over every replica) moves past where it stood, give or take ``_POLISH_TOL``.

    The refinements before it judge a swap by a replica's worst module. Where one module
    cannot get even (every padded speech clip costs one Whisper window, a few two: whatever
    the split, a replica's window count is 1.3% off the mean at dp 128), that module is the
    worst of every replica holding a long clip, no swap can lower it, and the other modules
    stay as uneven as the split left them: the LLM 0.36% over the mean on the slowest
    replicas of ``librispeech`` at 8192 / dp 128 (frozen encoders), where ``verl_kk``'s
    split of the LLM alone is within 0.002%; polished, within 0.01%. Each round takes a
    module (the modules in turn), pairs the replicas most over it with those most under and
    makes in every pair the swap that most lowers the pair's largest deviation on it. Only
    ``free`` replicas take part: one holding a stalling sample runs as long as the stall
    makes it, whatever its sums (:func:`_stalling`). Where every replica is within
    ``_POLISH_FROM`` of the mean on every module nothing is polished: there the replicas'
    level-2 sets differ by more (their own-ideal ratios 0.5% apart), and swaps at 1e-5 only
    reshuffled which replica drew which samples (at 512 / dp 4 it cost a told 4-iteration run
    0.6%)."""
    dp, n = members.shape
    d = loads.shape[1]
    idx = np.flatnonzero(free)
    if d < 2 or len(idx) < 2:
        return
    mean = loads.mean(axis=0)
    scale = np.where(mean > 0, mean, 1.0)
    if np.abs((loads - mean) / scale).max() < _POLISH_FROM:
        return  # even to 0.1%: level 2's spread between replicas is larger, a polish reshuffles
    c = min(n, _PAIR_CANDIDATES)
    base = np.linspace(0, n - 1, c).astype(np.int64)
    args = (_POLISH_ROUNDS, _GOOD_ENOUGH, _POLISH_TOL)
    if compiled.enabled():
        from .split_kernel import polish_modules  # numba is imported with it

        polish_modules(members, loads, wp, mean, scale, base, free, *args)
        return
    hi, lo = np.full(d, np.inf), np.full(d, -np.inf)
    wn = wp / scale
    for it in range(_POLISH_ROUNDS):
        k = it % d
        rel = (loads - mean) / scale  # [dp, D]
        hi = np.minimum(hi, rel.max(axis=0) + _POLISH_TOL)
        lo = np.maximum(lo, rel.min(axis=0) - _POLISH_TOL)
        order = idx[np.argsort(-rel[idx, k], kind="stable")]
        if max(abs(rel[order[0], k]), abs(rel[order[-1], k])) < _GOOD_ENOUGH:
            continue
        half = len(order) // 2
        a, b = order[:half], order[::-1][:half]  # most over with most under
        cols = (base + it * 5) % n if c < n else base
        ia, ib = members[a][:, cols], members[b][:, cols]  # [P, C]
        ok = (ia >= 0)[:, :, None] == (ib >= 0)[:, None, :]  # no sample for a pad
        v = np.zeros((half, c, c))
        for q in range(d):
            dq = wn[ia][:, :, None, q] - wn[ib][:, None, :, q]  # [P, C, C]
            na = rel[a, q][:, None, None] - dq
            nb = rel[b, q][:, None, None] + dq
            if q == k:
                v = np.maximum(np.abs(na), np.abs(nb))
            else:
                ok &= (np.maximum(na, nb) <= hi[q]) & (np.minimum(na, nb) >= lo[q])
        cur = np.maximum(np.abs(rel[a, k]), np.abs(rel[b, k]))
        _swap_best(members, loads, wp, a, b, cols, np.where(ok, v, np.inf).reshape(half, -1), cur)


def _swap_best(members, loads, wp, a, b, cols, flat, limit) -> None:
    """In every pair ``(a[i], b[i])`` the swap ``flat[i]`` [C * C] rates lowest (candidate
    ``x * C + y``: member ``cols[x]`` of ``a[i]`` for member ``cols[y]`` of ``b[i]``), made
    where it rates below ``limit[i]``; ``loads`` follow."""
    best = np.argmin(flat, axis=1)
    gain = flat[np.arange(len(a)), best] < limit - 1e-12
    if not gain.any():
        return
    x, y = np.divmod(best[gain], len(cols))
    ra, rb = a[gain], b[gain]
    ca, cb = cols[x], cols[y]
    dl = wp[members[ra, ca]] - wp[members[rb, cb]]
    loads[ra] -= dl
    loads[rb] += dl
    members[ra, ca], members[rb, cb] = members[rb, cb], members[ra, ca]


def _refine_pairs(members: np.ndarray, loads: np.ndarray, wp: np.ndarray, iters: int) -> None:
    """Pairwise swaps between all replicas at once: every round pairs the replicas most
    over a module with those most under it (the module cycles, then the worst one) and
    makes, in every pair, the member swap that most lowers the pair's worst relative
    deviation. One round costs O(dp * C^2 * D) array work, not dp rounds of Python."""
    dp, n = members.shape
    d = loads.shape[1]
    if dp < 2 or iters <= 0:
        return
    mean = loads.mean(axis=0)
    scale = np.where(mean > 0, mean, 1.0)
    c = min(n, _PAIR_CANDIDATES)
    base = np.linspace(0, n - 1, c).astype(np.int64)
    if compiled.enabled():
        from .split_kernel import refine_pairs  # numba is imported with it

        refine_pairs(members, loads, wp, mean, scale, base, iters, _GOOD_ENOUGH)
        return
    half = dp // 2
    for it in range(iters):
        rel = (loads - mean) / scale  # [dp, D]
        obj = np.abs(rel).max(axis=1)
        if obj.max() < _GOOD_ENOUGH:
            break
        # the modules' sum in a fixed order (cumsum), as the compiled twin sums
        key = rel[:, it % d] if it % (d + 1) < d else np.cumsum(rel, axis=1)[:, -1]
        order = np.argsort(-key, kind="stable")
        a, b = order[:half], order[::-1][:half]  # most over with most under
        cols = (base + it * 5) % n if c < n else base  # other members every round
        ia, ib = members[a][:, cols], members[b][:, cols]  # [P, C]
        wa, wb = wp[ia] / scale, wp[ib] / scale  # [P, C, D] on the relative scale
        new_obj = np.zeros((half, c, c))
        for k in range(d):  # one module at a time: reductions over a tiny last axis are slow
            dk = wa[:, :, None, k] - wb[:, None, :, k]  # [P, C, C]
            np.maximum(new_obj, np.abs(rel[a, k][:, None, None] - dk), out=new_obj)
            np.maximum(new_obj, np.abs(rel[b, k][:, None, None] + dk), out=new_obj)
        new_obj[(ia >= 0)[:, :, None] != (ib >= 0)[:, None, :]] = np.inf  # a sample for a pad
        _swap_best(
            members, loads, wp, a, b, cols, new_obj.reshape(half, -1), np.maximum(obj[a], obj[b])
        )


def _refine_replicas(members: np.ndarray, loads: np.ndarray, wp: np.ndarray, iters: int) -> None:
    """Pairwise swaps between the worst replica and its most complementary one."""
    dp, n = members.shape
    mean = loads.mean(axis=0)
    scale = np.where(mean > 0, mean, 1.0)
    cols = np.arange(n)
    if n > _SWAP_CANDIDATES:
        cols = np.linspace(0, n - 1, _SWAP_CANDIDATES).astype(np.int64)
    if compiled.enabled():
        from .split_kernel import refine_replicas  # numba is imported with it

        refine_replicas(members, loads, wp, mean, scale, cols, iters, _GOOD_ENOUGH)
        return
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
        # a sample for a pad would move a sample between replicas: counts must stay within one
        new_obj[(ia >= 0)[:, None] != (ib >= 0)[None, :]] = np.inf
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


def fit_caps(members: np.ndarray, x: Inputs, w: np.ndarray) -> np.ndarray:
    """Level 1, repaired for the caps: where a replica's samples cannot be packed into its
    ``m`` sets under the token cap (and each encoder's patch cap) by first fit, largest first,
    swap its largest sample for one of the least-loaded replica that still packs: of that
    replica's samples smaller under the caps, the one closest in work (``w`` [B, D], level
    1's columns). Level 1 balances work, not tokens, so with few
    samples per replica one replica can hold more tokens than its sets take while another
    has room: the batch is then served instead of failing mid-epoch, and the swap keeps the
    replicas' work as level 1 left it as far as it can (the smallest partner put 2% more work
    on one replica of vision-audio at 8192 / dp 128). A no-op (the same members) when every
    replica packs.
    """
    parts = []
    if x.max_tokens is not None:
        parts.append(x.tokens[:, None] / max(x.max_tokens, 1))
    if x.patches is not None and x.patch_cap is not None:
        parts.append(x.patches / np.maximum(x.patch_cap, 1)[None, :])
    if not parts or members.shape[0] == 1:
        return members
    size = np.vstack([np.concatenate(parts, axis=1), np.zeros((1, sum(p.shape[1] for p in parts)))])
    m = x.microbatches
    ok = _packs(size[members], m)
    if ok.all():
        return members
    members = members.copy()
    load = size[members].sum(axis=(1, 2))
    for o in np.argsort(-load):  # the fullest failing replicas first
        if ok[o]:
            continue
        for _ in range(members.shape[1]):
            mine = size[members[o]].max(axis=1)
            a = int(np.argmax(mine))
            swapped = False
            for u in np.argsort(size[members].sum(axis=(1, 2))):
                if u == o or not ok[u]:
                    continue
                theirs = np.where(members[u] >= 0, size[members[u]].max(axis=1), np.inf)
                smaller = theirs < mine[a]
                if not smaller.any():
                    continue
                gap = np.abs(w[members[u]] - w[members[o, a]]).sum(axis=1)
                b = int(np.argmin(np.where(smaller, gap, np.inf)))
                members[[o, u], [a, b]] = members[[u, o], [b, a]]
                now = _packs(size[members[[o, u]]], m)
                if now[1]:
                    ok[o], swapped = bool(now[0]), True
                    break
                members[[o, u], [a, b]] = members[[u, o], [b, a]]  # undo: u would not pack
            if ok[o] or not swapped:
                break  # packs now, or no swap helps
    if not ok.all():  # swaps keep the counts; some batches need a replica to hold fewer
        groups = [slice(0, 1), slice(1, None)] if x.max_tokens is not None else [slice(0, None)]
        members = _move_to_fit(members, size, m, [g for g in groups if size[:, g].shape[1]])
    return members


def _move_to_fit(members: np.ndarray, size: np.ndarray, m: int, groups: list[slice]) -> np.ndarray:
    """Move samples of replicas whose sets cannot hold them, largest first, to the
    least-loaded replicas that still can (a pad slot taken, or one more column of pads): a
    token cap of 10 over samples of 10, 1, 1, 1 tokens on 2 replicas of one microbatch packs
    only as {10}, {1, 1, 1}. Each resource group (``groups``: the tokens, which fill L sets,
    and the patches, which fill E sets) is packed on its own, as the sets take them; a replica
    whose groups each pack stays as it is. A replica keeps at least ``m`` samples (no empty
    set). Where no move helps, the set builder names the sample that cannot be packed."""

    def fits(rows: np.ndarray) -> np.ndarray:
        sub = size[members[rows]]
        return np.logical_and.reduce([_packs(sub[..., g], m) for g in groups])

    ok = fits(np.arange(members.shape[0]))
    for o in np.flatnonzero(~ok):
        while not ok[o] and (members[o] >= 0).sum() > m:
            mine = np.where(members[o] >= 0, size[members[o]].max(axis=1), -np.inf)
            moved = False
            for a in np.argsort(-mine, kind="stable")[: int((members[o] >= 0).sum())]:
                for u in np.argsort(size[members].sum(axis=(1, 2)), kind="stable"):
                    if u == o or not ok[u]:
                        continue
                    if not (members[u] < 0).any():
                        members = np.pad(members, ((0, 0), (0, 1)), constant_values=-1)
                    b = int(np.argmax(members[u] < 0))
                    members[u, b], members[o, a] = members[o, a], -1
                    if fits(np.array([u]))[0]:
                        moved = True
                        break
                    members[o, a], members[u, b] = members[u, b], -1  # undo: u would not pack
                if moved:
                    ok[o] = bool(fits(np.array([o]))[0])
                    break
            if not moved:
                break
    return members


def _packs(sizes: np.ndarray, m: int) -> np.ndarray:
    """[R] whether each replica's samples (``sizes`` [R, n, K], each resource over its cap, pads
    zero) fit ``m`` sets by first fit, largest first: vectorised over replicas."""
    if compiled.enabled():
        from .split_kernel import packs  # numba is imported with it

        return packs(np.ascontiguousarray(sizes, dtype=np.float64), m)
    r, n, _ = sizes.shape
    order = np.argsort(-sizes.max(axis=2), axis=1, kind="stable")
    items = np.take_along_axis(sizes, order[:, :, None], axis=1)
    loads = np.zeros((r, m, sizes.shape[2]))
    ok = np.ones(r, bool)
    rows = np.arange(r)
    for k in range(n):
        s = items[:, k]
        fits = (loads + s[:, None, :] <= 1.0 + 1e-9).all(axis=2)
        ok &= fits.any(axis=1)
        j = np.argmax(fits, axis=1)
        loads[rows, j] += np.where(ok[:, None], s, 0.0)
    return ok
