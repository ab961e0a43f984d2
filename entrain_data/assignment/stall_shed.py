"""Level 1 revisited: a replica whose pipeline stalls gives work to the fastest ones.

Level 1 evens every replica's per-module sums; that is the right goal only while a
replica's time follows its sums. A sample several times a mean microbatch (a long
transcript, a 2K page) stalls 1F1B wherever it sits: its microbatch holds up the stages
around it, and the replica holding it runs far longer than one with the same sums
(frozen ``common-voice-ps`` at 8192 / dp 128: 0.35 s against 0.27 s for the median
replica, stage sums within 4%; at any of the 16 positions, the other microbatches made
exactly even, 0.352-0.362 s). What it can give up is its other work: the replica's time
fell by what it gave (0.0145 s per 10% of its other work), and the fastest replicas
have room to take it.

:func:`shed_stalls` runs after level 2 on the proxy pipeline's per-replica times: every
replica slower than the mean by more than ``_STALL`` gives whole samples (none of its
heavy ones: those stall wherever they go), largest first, as much proxy work on its
busiest stage as it runs above the mean, each to the replica with the most room below
the mean (and room under the caps). The givers' sets are built again (level 2); a
receiver keeps its sets and puts each sample it takes into its lightest set that keeps
the caps (E = L for it). The result is kept only where the slowest replica's proxy time
falls and no module's per-microbatch CV over the whole batch rises past ``_CV_SHARE`` of
a random equal-count cut's (or ``_CV_SLACK`` above its own): a replica that gives clips
away runs lighter encoder microbatches, and though the encoder stages wait for the stall
anyway, balance stays the contract. Otherwise half as much is given, then a quarter.
Where every sample costs exactly the same on a module (padded speech) no cut is uneven there, so
giving samples away always breaks that bound and nothing moves. Where the caller opted into
bounded delay (``max_delay`` > 0) it traded each iteration's sample set for time already, and
the iterations where the carried heavy samples land stall on several of them: there no CV
bound applies (frozen ``common-voice-ps`` at 8192 / dp 128: ``entrain_d2`` 0.986 -> 1.028 of
``wlb_llm``, its encoder CV 0.071, still below ``sequential``'s 0.072), and every replica more
than ``_STALL_DELAYED`` (1%) slower than the mean gives work (at 4096 / dp 16 a landing's
slowest replicas ran 2.5-3% over the mean and gave nothing: 0.994 -> 1.000). Sample counts per
replica then differ; every sample is still in one set of one replica.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .common import Inputs, Replicas, module_cv, module_loads, random_cut_cv, slot_sums
from .pipeline_search import proxy_times, stage_costs

__all__ = ["cv_limit", "shed_stalls"]

_STALL = 0.05  # a replica this much slower than the mean (proxy time) gives work away
# ... or this much, where the caller opted into delay (no CV bound then, see the docstring):
# frozen common-voice-ps at 4096 / dp 16, d2 0.9941 -> 1.0003 of wlb_llm (at 5%, the
# landings' slowest replicas, 2.5-3% over the mean, gave nothing)
_STALL_DELAYED = 0.01
_HEAVY = 0.5  # of a mean microbatch on its busiest stage: a sample that stays where it is
_CAP_ROOM = 0.9  # a receiver's tokens (and patches) stay within this share of m caps
_GAIN = 0.002  # kept only where the slowest replica is at least this much faster
_CV_SHARE = 0.75  # and every module's batch-wide CV at most this share of a random cut's
_CV_SLACK = 0.10  # (or this much above its own, where it is above that already)
# shares of each stalled replica's excess given away, tried in turn (the first that is
# faster within the CV limits is kept)
_SHARES = (1.0, 0.5, 0.25)

# (Replicas after the moves, their stage costs, rows) -> (eidx, lidx) of ``rows``:
# level 2 again on the replicas that gave work away
Level2 = Callable[[Replicas, tuple, np.ndarray], tuple[np.ndarray, np.ndarray]]


def shed_stalls(
    x: Inputs,
    rp: Replicas,
    eidx: np.ndarray,
    lidx: np.ndarray,
    stage: tuple[np.ndarray, np.ndarray, np.ndarray],
    replicas: Callable[[np.ndarray], Replicas],
    level2: Level2,
    limit: np.ndarray | None = None,
) -> tuple[Replicas, np.ndarray, np.ndarray, tuple]:
    """(rp, eidx, lidx, stage) with stalled replicas' work given away (see the module
    docstring); the inputs unchanged where no replica stalls or giving does not pay.
    ``replicas(members)`` builds the replicas of a member matrix, ``level2(rp, stage, rows)``
    the sets of its replicas ``rows`` (the givers); a receiver keeps its sets and puts each
    sample it takes into its lightest set that has room under the caps. That and the
    checks that do not wait for the givers' new sets come first (:func:`_fails_early`):
    a share that cannot be kept costs no level 2. ``limit``: every module's batch-wide CV
    bound (:func:`cv_limit` of the sets before any shedding; by default of these): rounds
    after the first keep the first one's, so the slack is not taken again each round; none
    applies where ``x.max_delay`` > 0."""
    same = (rp, eidx, lidx, stage)
    r_count = rp.valid.shape[0]
    if x.stages == 1 or r_count < 2:
        return same
    delayed = x.max_delay > 0  # time is that option's contract: no balance bound
    t = proxy_times(rp, eidx, lidx, stage)
    target = float(t.mean())
    slow = np.flatnonzero(t > target * (1 + (_STALL_DELAYED if delayed else _STALL)))
    if len(slow) == 0:
        return same
    if delayed:
        limit = np.full(rp.module_costs.shape[2], np.inf)
    elif limit is None:
        limit = cv_limit(rp, eidx, lidx)
    moves = _moves(x, rp, stage, t, target, slow)  # [k, 4]: giver, position, receiver, share
    if len(moves) == 0:
        return same
    bar = t.max() * (1 - _GAIN)  # the slowest replica's time the moves must beat
    for share in _SHARES:
        kept = moves[moves[:, 3] <= share]
        if len(kept) == 0:
            continue
        members, givers = _apply(rp, kept)
        rp2 = replicas(members)
        wide = ((0, 0), (0, members.shape[1] - rp.members.shape[1]))  # receivers may grow
        # a pad's slot may hold anything: -1, so that a receiver's new sample is inserted
        # (a giver's rows keep their slots here: only the receivers' new samples have none)
        e2 = np.pad(np.where(rp.valid, eidx, -1), wide, constant_values=-1)
        l2 = np.pad(np.where(rp.valid, lidx, -1), wide, constant_values=-1)
        if not _insert(rp2, e2, l2):
            continue
        stage2 = stage_costs(rp2)
        if _fails_early(rp2, e2, l2, stage2, givers, bar, limit):
            continue
        e2[givers], l2[givers] = level2(rp2, stage2, givers)
        if proxy_times(rp2, e2, l2, stage2).max() > bar:
            continue
        if (_batch_cv(module_loads(rp2, e2, l2)) <= limit + 1e-12).all():
            return rp2, e2, l2, stage2
    return same


def cv_limit(rp: Replicas, eidx: np.ndarray, lidx: np.ndarray) -> np.ndarray:
    """[K] every module's batch-wide CV bound for the sets (eidx, lidx): :data:`_CV_SHARE` of a
    random equal-count cut's, or :data:`_CV_SLACK` above their own where that is higher."""
    cv0 = _batch_cv(module_loads(rp, eidx, lidx))
    flat = rp.module_costs[rp.valid][None]  # the whole batch as one replica of R * m sets
    rc = random_cut_cv(flat, np.ones(flat.shape[:2], bool), rp.m * rp.valid.shape[0])[0]
    return np.maximum(cv0 * (1 + _CV_SLACK), _CV_SHARE * rc)


def _fails_early(rp, eidx, lidx, stage, givers, bar, limit) -> bool:
    """Whether the moves fail the checks whatever level 2 builds on the ``givers``, whose
    rows in (eidx, lidx) still hold their old sets less what they gave: every other
    replica's sets are final, so one of them slower than ``bar`` fails the time check;
    and each module's batch CV is at least the one with every giver's sets made exactly
    even (its sums are fixed, so is the batch mean; even sets add the least variance),
    so that above ``limit`` fails the balance check."""
    others = np.ones(rp.valid.shape[0], bool)
    others[givers] = False
    if (proxy_times(rp, eidx, lidx, stage)[others] > bar).any():
        return True
    loads = module_loads(rp, eidx, lidx)
    loads[givers] = loads[givers].mean(axis=1, keepdims=True)
    return bool((_batch_cv(loads) > limit * (1 + 1e-9) + 1e-12).any())


def _moves(x, rp, stage, t, target, slow) -> np.ndarray:
    """[k, 4] every stalled replica's samples to give, largest first (giver, position,
    receiver, the share of the giver's excess given once this one is): all of the excess,
    so that a smaller share is a prefix of each giver's moves."""
    r_count, m = rp.valid.shape[0], rp.m
    per = sum(stage)  # [R, n, S] forward + backward per proxy stage
    sums = per.sum(axis=1)  # [R, S]
    busiest = sums.argmax(axis=1)
    cost = np.take_along_axis(per, busiest[:, None, None], axis=2)[..., 0]  # [R, n]
    heavy = cost > _HEAVY * sums[np.arange(r_count), busiest][:, None] / m
    room = np.maximum(target - t, 0.0)
    room[slow] = 0.0
    tok_room = None if x.max_tokens is None else _CAP_ROOM * m * x.max_tokens - rp.tok.sum(axis=1)
    pt_room = None if x.patch_cap is None else _CAP_ROOM * m * x.patch_cap - rp.patches.sum(axis=1)
    out = []
    for r in slow[np.argsort(-t[slow], kind="stable")]:
        excess = t[r] - target
        need = excess
        ok = rp.valid[r] & ~heavy[r]
        spare = int(rp.valid[r].sum()) - m  # every L set keeps a sample
        for i in np.flatnonzero(ok)[np.argsort(-cost[r][ok], kind="stable")]:
            c = cost[r, i]
            if spare <= 0:
                break
            if c > need:
                continue  # a smaller one may still fit what is left to give
            fits = room >= c
            if tok_room is not None:
                fits &= tok_room >= rp.tok[r, i]
            if pt_room is not None:
                fits &= (pt_room >= rp.patches[r, i][None, :]).all(axis=1)
            if not fits.any():
                continue
            u = int(np.argmax(np.where(fits, room, -np.inf)))
            room[u] -= c
            if tok_room is not None:
                tok_room[u] -= rp.tok[r, i]
            if pt_room is not None:
                pt_room[u] -= rp.patches[r, i]
            need -= c
            spare -= 1
            out.append((r, i, u, 1.0 - need / excess))
    return np.array(out).reshape(-1, 4)


def _apply(rp: Replicas, moves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(member matrix, givers) after ``moves``: a giver's members stay in place (pads where
    it gave), a receiver's new ones follow its own (the matrix widens if needed)."""
    r_count = rp.valid.shape[0]
    giver, pos, recv = (moves[:, c].astype(np.int64) for c in range(3))
    members = rp.members.copy()
    taken = rp.members[giver, pos]
    members[giver, pos] = -1
    count = rp.valid.sum(axis=1) - np.bincount(giver, minlength=r_count)
    count += np.bincount(recv, minlength=r_count)
    out = np.full((r_count, max(int(count.max()), members.shape[1])), -1, np.int64)
    out[:, : members.shape[1]] = members
    for u in np.unique(recv):
        new = taken[recv == u]
        last = np.flatnonzero(rp.valid[u])
        start = int(last.max()) + 1 if len(last) else 0
        free = np.flatnonzero(out[u, start:] < 0)[: len(new)] + start
        if len(free) < len(new):  # pads inside the row: the first free positions
            free = np.flatnonzero(out[u] < 0)[: len(new)]
        out[u, free] = new
    return out, np.unique(giver)


def _insert(rp: Replicas, eidx: np.ndarray, lidx: np.ndarray) -> bool:
    """Put every member without a slot (``eidx`` < 0 where valid: a receiver's new samples)
    into its replica's set lightest on the modules together (E = L, so the release rule
    holds) that keeps the token and patch caps; in place. False where one does not fit."""
    r_idx, pos = np.nonzero(rp.valid & (eidx < 0))
    if len(r_idx) == 0:
        return True
    m = rp.m
    cost = rp.module_costs
    placed = rp.valid & (eidx >= 0)
    unit = np.where(placed[..., None], cost, 0.0).sum(axis=(0, 1)) / (m * len(placed))
    unit = np.where(unit > 0, unit, 1.0)
    # the receivers' set loads (row by row: the same sums as over every replica)
    rows, local = np.unique(r_idx, return_inverse=True)
    e_r, l_r, p_r, c_r = eidx[rows], lidx[rows], placed[rows], cost[rows]
    load = (
        slot_sums(e_r, c_r[..., :-1], p_r, m).sum(axis=2) / unit[:-1].sum()
        + slot_sums(l_r, c_r[..., -1:], p_r, m)[..., 0] / unit[-1]
    )  # [receivers, m]
    tok = slot_sums(l_r, rp.tok[rows, :, None].astype(np.float64), p_r, m)[..., 0]
    pts = slot_sums(e_r, rp.patches[rows].astype(np.float64), p_r & rp.has_enc[rows], m)
    for k, r, i in zip(local, r_idx, pos):
        fits = np.ones(m, bool)
        if rp.cap is not None:
            fits &= tok[k] + rp.tok[r, i] <= rp.cap
        if rp.patch_cap is not None and rp.has_enc[r, i]:
            fits &= (pts[k] + rp.patches[r, i] <= rp.patch_cap + 0.5).all(axis=1)
        if not fits.any():
            return False
        j = int(np.argmin(np.where(fits, load[k], np.inf)))
        eidx[r, i] = lidx[r, i] = j
        load[k, j] += cost[r, i, :-1].sum() / unit[:-1].sum() + cost[r, i, -1] / unit[-1]
        tok[k, j] += rp.tok[r, i]
        pts[k, j] += rp.patches[r, i]
    return True


def _batch_cv(loads: np.ndarray) -> np.ndarray:
    """[K] per-microbatch CV of every module over the whole batch (``loads`` [R, m, K], all
    replicas' sets together, as ``metrics.microbatch_loads`` reports it)."""
    return module_cv(loads.reshape(1, -1, loads.shape[2]))[0]
