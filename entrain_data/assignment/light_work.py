"""The light work of the slowest replicas, laid where the pipeline wants it.

1F1B runs the first forwards and the last backwards alone: even microbatches leave that fill
and drain to the pipeline, and a replica holding a sample heavier than a mean microbatch
(:func:`.pipeline_search.outliers`) cannot run even microbatches at all. The shape that runs
fastest is not the one a rule of thumb gives. On the bench's simulator a local search over
whole-sample moves took outlier replicas 3.5-11% below entrain's sets (bench/RESULTS.md,
eighteenth session), always to the same kind of profile: nearly nothing at the edges, the
light work rising towards the heavy microbatches and falling after them. Without outliers
the fastest profile rises from light first microbatches to a plateau and falls at the end:
at 4096 / dp 16 / 16 it ran 2-4.5% below entrain's sets by the proxy (twentieth session),
where the pipeline search is held to a twentieth of a random cut's CV
(:func:`.pipeline_search.cv_limits`); within 0.8 of a random cut's CV, 1.2-1.8% below on
the high-variance rows (qwen2vl-dynamic, sroie-docs, multi-image-video, video-nextqa).

Here the heavy samples (work on the proxy's stages above ``_HEAVY`` of a mean microbatch)
keep their E and L microbatches, and the rest of the replica's work is treated as a fluid:
the share of it each microbatch carries (the profile) is optimised on the proxy 1F1B
pipeline itself (:func:`fluid_profile`: exchange descent on the slopes of the simulated
time, every replica at once, each microbatch's share bounded so its tokens and patches
stay under ``_CAP_AIM`` of the caps and under the batch's :func:`_peaks`), three times: free
from even shares, free from the replica's present shares (from even shares the descent's
steps can end short of where the heavy samples' slots want the light work), and within a
CV bound (every module's fluid CV at most ``_CV_AIM`` of a random equal-count cut's, or its
present CV where that is larger, starting from the furthest point towards the first free
profile within it from the present shares). The light samples are dealt to each profile,
heaviest first, to the microbatch furthest below its share that still fits the caps and
the peaks (the layout may not raise the batch's largest sets past them), as joint sets
(E = L: their encoder output never waits); each profile twice, on the work alone and on
every module and the work together (a module the work does not follow, such as the sum of
two encoders, is left as uneven as the draw by the first and held to the share by the
second). A
replica takes the fastest of the six deals where the caps hold, no LLM set is empty (where it
holds at least as many samples as microbatches) and every module's per-microbatch CV stays
within a random equal-count cut's: the contract that no module ends less even than a
cost-blind cut leaves it (the free profile alone broke it on most replicas without
outliers). The pipeline search then runs once more from there on those replicas (the heavy
samples' slots were found for the old light work), the same bound and a proxy time no longer
than the deal's held after it; not on a replica whose deal already ends below the goal the
profiles stop at (below, the first replica left out, the iteration cannot get shorter:
untold at 8192 / dp 128, searching those cost ``qwen2vl-dynamic``/vl-1b 7 ms of its 59).
A deal whose proxy time fell is kept; one up to ``_NEAR`` slower than the present sets is
kept only where the search from it ends faster than them (``text-heavy``/vl-1b with frozen
encoders at 4096 / dp 16, iteration 3: the slowest replica's best deal ran 0.04% over its
present sets, where every other replica's deal and search took 5% off; searched from, it
took 3.8% off too).

The optimisation costs a few hundred simulated pipelines per replica, and the iteration
waits for its slowest replica, so it runs on the slowest replicas only: at most ``_FOCUS``,
and not at all where the first replica left out runs within ``_ROOM`` of the slowest (the
iteration could not get shorter by more; at 8192 / dp 128, on 8 replicas holding outliers,
it cost 30-45 ms an assignment for 0.1-0.5% on a few rows; at 4096 / dp 16 on all 16 it
takes the assignment from 49 to 121-124 ms). Where "slowest" is by a depth-blind price (the
depth untold), that holds by the price and by the fitted depth's own times alike: a fit to a
depth on which the iteration cannot get shorter is not laid (at 8192 / dp 128 untold, most
rows' replicas run within 0.4% of each other on 4 stages: skipping that fit took
``qwen2vl-dynamic``/vl-1b from 83 to 66 ms an assignment, the balance bench's mean 1.0404 ->
1.0402 run on 4 stages and 1.0266 -> 1.0257 on 8). Where replicas are left out, each profile's
descent stops ``_GOAL_MARGIN`` below the first of them (the iteration cannot get shorter than
it): at 8192 / dp 128 the free profile went on to 4-14% below it and the deal to 2-11%, 75-145
ms an assignment where it ran; stopped 4% below, 19-70 ms with the same balance bench figures
(bench/RESULTS.md, twenty-first session). "Slowest" is among the replicas it is given: the stall
shedding's level 2 of its givers gives it only those. Where the plan's depth is not
told the proxy's depth is a guess, and a profile fitted to a guessed fill and drain may be
fitted to the wrong pipeline: the caller (:func:`.entrain._shaped_untold`) fits it on two
depths and keeps a fit only where no depth it hedges over runs the replica slower.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import compiled
from .common import Replicas, module_cv, module_loads, random_cut_cv, slot_sums
from .llm_sets import empty_llm_set, fits_patches, fits_tokens
from .pipeline_search import (
    _pipeline_times,
    _topo,
    proxy_times,
    refine_by_pipeline,
    stage_rows,
)

__all__ = ["fluid_profile", "lay_light_work"]

_HEAVY = 0.5  # a sample above this share of a mean microbatch's work keeps its slots
_CAP_AIM = 0.9  # a microbatch's share aims its tokens and patches at most this near the caps
_FOCUS = 16  # replicas laid out per call, at most: the slowest
_NEAR = 0.02  # a deal this much slower than the present sets is still searched from (below)
_ROOM = 0.005  # nothing is laid out where the next slowest is within this share of the slowest
_STEPS = 32  # exchange steps of the profile's descent
_SLOPE_STEP = 0.02  # finite-difference step, share of a mean microbatch's light work
_PAIRS = 6  # moves tried per step: from each of the 6 best sources to each of the 6 best sinks
_HALVINGS = 3  # a replica's descent stops once its slope step has halved more often than this
_TRIES = np.array([1.0, 0.25, 0.0625])  # ... at these shares of the largest move
_CV_AIM = 0.9  # the profile's CVs aim at most this near a random cut's (the deal adds some)
_BISECTIONS = 12
_BLIND_SPREAD = 1.0  # the layout's largest set: at least this many blind-cut deviations up
_GOAL_MARGIN = 0.04  # a profile stops this far below the first replica left out (the deal's
# slack: 2% lost up to 0.6% on a row of the bench at 8192 / dp 128, 4% none)


def fluid_profile(
    fh: np.ndarray,
    bh: np.ndarray,
    fl: np.ndarray,
    bl: np.ndarray,
    upper: np.ndarray,
    start: np.ndarray | None = None,
    spread: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    goal: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(time [R], share [R, m]): the share of the light work each microbatch carries that
    minimises the 1F1B time of forward loads ``fh + share * fl`` and backward loads ``bh +
    share * bl`` (``fh``, ``bh`` [R, m, S] the heavy samples' loads, ``fl``, ``bl`` [R, S]
    the light work's totals), with ``0 <= share <= upper`` [R, m] and shares summing to 1
    (where the bounds allow it), starting from even shares or ``start`` [R, m]. With
    ``spread`` = (hk [R, m, K], lk [R, K], limit [R, K]) every module's per-microbatch CV of
    the loads ``hk + share * lk`` stays within ``limit`` too (moves that leave it are not
    taken: the start must be within it). A replica whose time is at most ``goal`` [R] stops
    there: nothing below it shortens the iteration.

    The time is a maximum of sums of loads linear in the shares (the longest path of the
    schedule), so it is convex in them, but not smooth: slopes alone stall at its kinks
    (measured: stuck above the start on a third of the replicas). Each step measures every
    microbatch's slope both ways (a small share added, a small share removed; one way only
    lost most of the gain), tries moving share from each of the ``_PAIRS`` microbatches
    whose removal helps most to each of the ``_PAIRS`` whose addition costs least, at a few
    sizes, and keeps the best move; a replica whose best move does not help halves its slope
    step, and stops once that step has halved more than ``_HALVINGS`` times."""
    r_count, m, s_count = fh.shape
    topo = _topo(m, s_count)
    if start is not None:
        share = start.copy()
    else:
        share = np.minimum(np.full((r_count, m), 1.0 / m), upper)
        room = np.minimum(upper - share, 1.0)
        short = np.maximum(1.0 - share.sum(axis=1), 0.0)[:, None]
        spare = np.maximum(room.sum(axis=1), 1e-12)[:, None]
        share = np.minimum(share + room * short / spare, upper)

    def times(a: np.ndarray, g: np.ndarray) -> np.ndarray:
        """[g, P]: the probes ``a`` [g, P, m] of rows ``g``, small changes of their present
        shares."""
        p = a.shape[1]
        f = fh[g, None] + a[..., None] * fl[g, None, None]
        b = bh[g, None] + a[..., None] * bl[g, None, None]
        shape = (len(g) * p, m, s_count)
        return _pipeline_times(f.reshape(shape), b.reshape(shape), topo).reshape(len(g), p)

    goal = np.zeros(r_count) if goal is None else goal
    if compiled.enabled():  # the whole descent compiled
        from .fluid_kernel import fluid_descent  # numba is imported with it

        if spread is None:
            bound = (np.zeros((r_count, m, 0)),) + (np.zeros((r_count, 0)),) * 4
        else:  # the statistics of the heavy loads :func:`_fluid_cv` reads, per row
            hk, lk, limit = spread
            bound = (*_heavy_moments(hk), lk, limit)
        min_step = _SLOPE_STEP / m / 2**_HALVINGS
        c = np.ascontiguousarray
        cur = fluid_descent(fh, bh, fl, bl, upper, share, goal, topo, _STEPS, _PAIRS, _TRIES,
                            min_step, _SLOPE_STEP / m, *(c(b) for b in bound))  # fmt: skip
        return cur, share
    cur = times(share[:, None], np.arange(r_count))[:, 0]
    step = np.full(r_count, _SLOPE_STEP / m)
    k = min(_PAIRS, m)
    eye = np.eye(m)
    for _ in range(_STEPS):
        g = np.flatnonzero((step >= _SLOPE_STEP / m / 2**_HALVINGS) & (cur > goal))
        if len(g) == 0:
            break
        a, rows = share[g], np.arange(len(g))
        d = step[g, None, None] * eye
        probe = times(
            np.concatenate([a[:, None] + d, a[:, None] - np.minimum(d, a[:, None])], 1), g
        )
        add = np.where(upper[g] - a > 1e-12, probe[:, :m], np.inf)
        take = np.where(a > 1e-12, probe[:, m:], np.inf)
        dst = np.tile(np.argsort(add, axis=1, kind="stable")[:, :k], (1, k))  # [g, k*k] pairs
        src = np.repeat(np.argsort(take, axis=1, kind="stable")[:, :k], k, axis=1)
        most = np.minimum(np.take_along_axis(a, src, 1), np.take_along_axis(upper[g] - a, dst, 1))
        most = np.where(src == dst, 0.0, np.maximum(most, 0.0))
        amount = (most[..., None] * _TRIES).reshape(len(g), -1)  # [g, k*k*T]
        src, dst = np.repeat(src, len(_TRIES), axis=1), np.repeat(dst, len(_TRIES), axis=1)
        moves = np.repeat(a[:, None], src.shape[1], axis=1)
        at = np.arange(src.shape[1])[None, :]
        moves[rows[:, None], at, src] -= amount
        moves[rows[:, None], at, dst] += amount
        moves = np.maximum(moves, 0.0)
        got = times(moves, g)
        if spread is not None:  # the moves within the CV bound (a quarter, where it binds)
            hk, lk, limit = spread
            cv = _fluid_cv(hk[g], lk[g], moves)  # [g, P, K]
            got = np.where((cv <= limit[g, None] + 1e-12).all(axis=2), got, np.inf)
        best = got.argmin(axis=1)
        better = got[rows, best] < cur[g] * (1 - 1e-9)
        share[g] = np.where(better[:, None], moves[rows, best], a)
        cur[g] = np.where(better, got[rows, best], cur[g])
        step[g] = np.where(better, step[g], step[g] / 2)
    return cur, share


def lay_light_work(
    rp: Replicas,
    eidx: np.ndarray,
    lidx: np.ndarray,
    stage: tuple[np.ndarray, ...],
    cur: np.ndarray,
    rng: np.random.Generator,
    rank: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(eidx, lidx)`` with the light samples of the slowest replicas re-laid on their
    :func:`fluid_profile` (free from even or present shares, or within the CV bound),
    searched once more from there, where that shortens the replica's proxy iteration within
    the caps and the CV bound (the module docstring)
    (:func:`.pipeline_search.refine_by_pipeline`, ``rng``'s draws: the heavy samples' slots
    were found for the old light work; measured at 512 / dp 4 / 32, 0.2-2% more on five
    rows, none less); the other replicas unchanged. ``stage``: the (ef, lf,
    lb) of :func:`.pipeline_search.stage_costs`; ``cur``: the proxy times [R] of ``(eidx,
    lidx)`` on it (level 2 has them); ``rank`` [R]: what "slowest" means where that is not
    ``cur`` (the depth-blind price, where the depth is guessed; the room is then read on
    both)."""
    m = rp.m
    # under 3 microbatches or on one stage there is no fill and drain to shape around
    if m < 3 or rp.stages < 2 or not rp.depth_known:
        return eidx, lidx
    rank = cur if rank is None else rank
    slowest = np.argsort(-rank, kind="stable")
    count = min(_FOCUS, len(cur))
    if count < len(cur) and (_no_room(rank, count) or _no_room(cur, count)):
        return eidx, lidx  # the first one it cannot help is within the room of the slowest
    ceiling = cur[slowest[count:]].max(initial=0.0)  # the slowest of those left out
    rows = np.sort(slowest[:count])
    peaks = _peaks(rp, eidx, lidx)
    aimed, rp = _capped(rp, peaks, _CAP_AIM), _capped(rp, peaks)
    sub = rp.take(rows)
    ef, lf, lb = stage_rows(stage, rows)
    es, ls = eidx[rows], lidx[rows]
    work = (ef + lf + lb).sum(axis=2)  # [r, n]
    heavy = sub.valid & (work > _HEAVY * work.sum(axis=1, keepdims=True) / m)
    light = sub.valid & ~heavy
    fh = slot_sums(es, ef, heavy, m) + slot_sums(ls, lf, heavy, m)
    bh = slot_sums(ls, lb, heavy, m)
    lit = light[..., None]
    fl = np.where(lit, ef + lf, 0.0).sum(axis=1)
    bl = np.where(lit, lb, 0.0).sum(axis=1)
    upper = _upper(sub, es, ls, heavy, light, aimed)
    # the iteration waits for the replicas left out: a profile below them gains nothing
    goal = np.full(count, ceiling * (1 - _GOAL_MARGIN))
    _, free = fluid_profile(fh, bh, fl, bl, upper, goal=goal)
    limit = sub.cut_cv
    hk = module_loads(sub, np.where(heavy, es, -1), np.where(heavy, ls, -1))
    lk = np.where(lit, sub.module_costs, 0.0).sum(axis=1)
    now = _shares_now(es, ls, ef, lf + lb, light, m)
    cv_aim = np.maximum(_CV_AIM * limit, _fluid_cv(hk, lk, now))
    start = _towards(now, free, hk, lk, cv_aim)
    spread = (hk, lk, cv_aim)
    _, bounded = fluid_profile(fh, bh, fl, bl, np.maximum(upper, now), start, spread, goal)
    # and free from the present shares: from even shares the descent's steps end short of
    # where the heavy samples' slots want the light work (qwen2vl-dynamic with frozen encoders
    # at 4096 / dp 16: that profile ran 0.9-2.1% slower than the present sets on the 8 traced)
    # (a present share above the aimed caps may stay, as for the bounded one: the deal's
    # check holds the caps themselves)
    _, from_now = fluid_profile(fh, bh, fl, bl, np.maximum(upper, now), now, None, goal)
    # every profile dealt, on the work alone and on every module: the free ones' sets often
    # end within the CV bound though their fluid's CVs are above the aim (the heavy samples'
    # microbatches), the bounded one's where they do not; the fastest taken
    st = (ef, lf, lb)
    e2, l2, t2, ok = _dealt(sub, es, ls, st, work, light, free, cur[rows], limit, False)
    deals = [(bounded, False), (free, True), (bounded, True), (from_now, False), (from_now, True)]
    for share, by_module in deals:
        e3, l3, t3, ok3 = _dealt(sub, es, ls, st, work, light, share, cur[rows], limit, by_module)
        use = ok3 & (~ok | (t3 < t2))
        e2, l2 = np.where(use[:, None], e3, e2), np.where(use[:, None], l3, l2)
        t2, ok = np.where(use, t3, t2), ok | ok3
    faster = ok & (t2 < cur[rows] * (1 - 1e-9))
    taken = rows[ok]
    if len(taken) == 0:
        return eidx, lidx
    eidx, lidx = eidx.copy(), lidx.copy()
    sub, st_ok = rp.take(taken), stage_rows((ef, lf, lb), ok)
    e_k, l_k = e2[ok], l2[ok]
    # the iteration waits for the replicas left out: a deal that ends below the goal the
    # profiles stopped at is not searched from (the search could not shorten the iteration)
    hunt = np.flatnonzero(t2[ok] > goal[ok])
    if len(hunt):
        hs = sub.take(hunt)
        e_s, l_s = refine_by_pipeline(hs, e_k[hunt], l_k[hunt], rng, stage=stage_rows(st_ok, hunt))
        # the search's CV limits follow its start: hold the random cut's bound after it too
        keep = _within(hs, e_s, l_s, limit[ok][hunt])
        e_k[hunt] = np.where(keep[:, None], e_s, e_k[hunt])
        l_k[hunt] = np.where(keep[:, None], l_s, l_k[hunt])
    # a deal that was not faster is kept only where the search from it is
    t_k = proxy_times(sub, e_k, l_k, st_ok)
    won = faster[ok] | (t_k < cur[taken] * (1 - 1e-9))
    eidx[taken] = np.where(won[:, None], e_k, eidx[taken])
    lidx[taken] = np.where(won[:, None], l_k, lidx[taken])
    return eidx, lidx


def _no_room(times: np.ndarray, count: int) -> bool:
    """Whether the ``count + 1``-th slowest of ``times`` runs within ``_ROOM`` of the
    slowest: laying out the ``count`` slowest cannot shorten them by more."""
    nth = np.partition(times, len(times) - count - 1)[len(times) - count - 1]
    return bool(nth >= times.max() * (1 - _ROOM))


def _peaks(rp: Replicas, eidx: np.ndarray, lidx: np.ndarray) -> tuple[float, np.ndarray]:
    """The largest LLM set (tokens) and encoder set (patches [E]) the layout may build: the
    batch's present peak of ``(eidx, lidx)`` over all of ``rp``'s replicas, or, where larger,
    a mean microbatch plus ``_BLIND_SPREAD`` of a blind cut's standard deviation on the
    replica where that is largest (a blind equal-count cut's largest set is two to three
    deviations above the mean). Left to the caps alone the layout rose above `sequential`'s
    largest set on 6 of 34 rows at 512 / dp 4 / 32 (real:video-activitynet's 22% above); held
    to the present peak it gave up half its gain at 4096 / dp 16 (a plateau of light work is
    higher than even sets)."""
    valid, enc = rp.valid, rp.valid & rp.has_enc
    tok, pat = rp.tok.astype(np.float64), rp.patches.astype(np.float64)
    tok_now = slot_sums(lidx, tok, valid, rp.m).max(initial=0)
    pat_now = slot_sums(eidx, pat, enc, rp.m).max(axis=(0, 1))
    return max(tok_now, _blind(tok[..., None], valid, rp.m)[0]), np.maximum(
        pat_now, _blind(pat, enc, rp.m)
    )


def _blind(values: np.ndarray, valid: np.ndarray, m: int) -> np.ndarray:
    """[K] the largest over replicas of a mean microbatch of ``values`` [R, n, K] plus
    ``_BLIND_SPREAD`` deviations of a random equal-count cut's microbatch."""
    mean = np.where(valid[..., None], values, 0.0).sum(axis=1) / m  # [R, K]
    return (mean * (1 + _BLIND_SPREAD * random_cut_cv(values, valid, m))).max(axis=0)


def _capped(rp: Replicas, peaks: tuple[float, np.ndarray], aim: float = 1.0) -> Replicas:
    """``rp`` with its caps at ``aim`` of themselves and at most the ``peaks``."""
    tok, pat = peaks
    tok = tok if rp.cap is None else min(aim * rp.cap, tok)
    pat = pat if rp.patch_cap is None else np.minimum(aim * rp.patch_cap, pat)
    # whole tokens and patches, as the caps the search reads (it takes them as integers)
    return replace(rp, cap=int(np.floor(tok)), patch_cap=np.floor(pat).astype(np.int64))


def _dealt(sub, es, ls, st, work, light, share, cur, limit, by_module):
    """(eidx, lidx, proxy times, taken) of :func:`_deal` to ``share`` [r, m]: taken where
    the replica runs less than ``_NEAR`` longer than ``cur`` [r], within the caps with no LLM
    set empty, and every module within ``limit`` [r, K] (a random cut's CVs)."""
    e2, l2 = _deal(sub, es, ls, work, light, share, by_module)
    t2 = proxy_times(sub, e2, l2, st)
    fits = fits_tokens(sub, l2) & fits_patches(sub, e2) & ~empty_llm_set(l2, sub.valid, sub.m)
    near = t2 < cur * (1 + _NEAR)
    return e2, l2, t2, near & fits & _within(sub, e2, l2, limit)


def _upper(sub: Replicas, es, ls, heavy, light, aimed: Replicas) -> np.ndarray:
    """[r, m] the largest share of the light work each microbatch may carry: its tokens
    (with the heavy samples' in its L set) and its patches (with theirs in its E set) within
    ``aimed``'s caps (:func:`_capped`: ``_CAP_AIM`` of the caller's caps and the batch's
    :func:`_peaks`) if the light samples' tokens and patches follow their work (they do not
    exactly: the check after the deal holds the caps)."""
    m = sub.m
    held = slot_sums(ls, sub.tok.astype(np.float64), heavy, m)
    total = np.where(light, sub.tok, 0).sum(axis=1).astype(np.float64)
    upper = (aimed.cap - held) / np.maximum(total, 1.0)[:, None]
    pat = _patch_sizes(sub)
    held = slot_sums(es, pat, heavy, m)  # [r, m, E]
    total = np.where(light[..., None], pat, 0.0).sum(axis=1)  # [r, E]
    room = (aimed.patch_cap - held) / np.maximum(total, 1.0)[:, None, :]
    upper = np.minimum(upper, np.where(total[:, None, :] > 0, room, np.inf).min(axis=2))
    return np.maximum(upper, 0.0)


def _deal(
    sub: Replicas, es, ls, work, light, share, by_module: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The light samples, heaviest first, each into the microbatch furthest below its share
    of the light work among those its tokens and patches fit (any where none fits: the caps
    check then rejects the replica), E = L. Once only as many light samples are left as
    microbatches without an LLM set, they go there: no LLM set may be empty.

    ``by_module``: every module's light load (:attr:`.common.Replicas.module_costs`) and the
    work follow the share together: a sample goes where its columns, each relative to a mean
    microbatch of it, fill the deficits most (the least sum of squared deviations from the
    targets; the work alone is its one-column case). Dealt on the work alone, a module the
    work does not follow ends as uneven as the draw makes it: the sum of two encoders of a
    vision + audio mix at 4096 / dp 16 ended 0.082-0.109 against its 0.08 bound on the
    slowest four replicas, which kept their even sets and ran 1.2% longer than the rest."""
    r_count, m = share.shape
    rows = np.arange(r_count)
    heavy = sub.valid & ~light
    e2, l2 = np.where(light, -1, es), np.where(light, -1, ls)
    cols, weight, total = _deal_columns(sub, work, light, by_module)
    target = share[..., None] * total[:, None, :]
    load = np.zeros_like(target)  # [r, m, D]
    tok = slot_sums(ls, sub.tok.astype(np.float64), heavy, m)
    pat_s = _patch_sizes(sub)
    pat = slot_sums(es, pat_s, heavy, m)  # [r, m, E]
    count = slot_sums(ls, np.ones(ls.shape), heavy, m)
    cap, pcap = float(sub.cap), sub.patch_cap + 0.5  # set by _capped
    order = np.argsort(np.where(light, -work, np.inf), axis=1, kind="stable")
    left = light.sum(axis=1)
    tok_s = sub.tok.astype(np.float64)
    if compiled.enabled():
        from .search_kernel import deal_light  # numba is imported with it

        slot = np.where(light, -1, es)
        deal_light(order, left, cols, weight, tok_s, pat_s, target, load, tok, pat, count,
                   cap, pcap.astype(np.float64), slot)  # fmt: skip
        return slot, np.where(light, slot, ls)
    for k in range(int(left.max(initial=0))):
        act = k < left
        s = order[:, k]
        fit = (tok + tok_s[rows, s, None] <= cap) & (pat + pat_s[rows, s, None, :] <= pcap).all(2)
        empty = count < 0.5
        must = (left - k <= empty.sum(axis=1))[:, None]
        allowed = np.where(must, empty, fit)
        allowed = np.where(allowed.any(axis=1, keepdims=True), allowed, True)
        fill = (target - load) * weight[rows, s][:, None, :]
        gap = fill[..., 0]
        for d in range(1, fill.shape[2]):  # summed in the compiled twin's order
            gap = gap + fill[..., d]
        j = np.where(allowed, gap, -np.inf).argmax(axis=1)
        g = rows[act]
        e2[g, s[act]] = l2[g, s[act]] = j[act]
        load[g, j[act]] += cols[g, s[act]]
        tok[g, j[act]] += tok_s[g, s[act]]
        pat[g, j[act]] += pat_s[g, s[act]]
        count[g, j[act]] += 1
    return e2, l2


def _deal_columns(sub: Replicas, work, light, by_module: bool):
    """(columns [r, n, D], weights [r, n, D], light totals [r, D]) :func:`_deal` fills: the
    work alone (weight 1), or every module and the work, each sample's column weighed by
    itself over the square of a mean microbatch's light load of that column (the slope of
    the squared relative deviation a sample adds)."""
    if by_module:
        cols = np.concatenate([sub.module_costs, work[..., None]], axis=2)
    else:
        cols = np.ascontiguousarray(work[..., None])
    total = np.where(light[..., None], cols, 0.0).sum(axis=1)  # [r, D]
    if not by_module:
        return cols, np.ones(cols.shape), total
    mean = total / sub.m
    safe = np.where(mean > 0, mean, 1.0)[:, None, :]  # divided twice: a tiny mean's square
    return cols, np.where(mean[:, None, :] > 0, cols / safe / safe, 0.0), total  # underflows


def _shares_now(es, ls, ef, with_l, light, m: int) -> np.ndarray:
    """[r, m] the share of the light work each microbatch carries in the sets (es, ls): a
    sample's E-set work (``ef``) where its E set is, the rest (``with_l``) where its L set is."""
    load = slot_sums(es, ef.sum(axis=2), light, m) + slot_sums(ls, with_l.sum(axis=2), light, m)
    return load / np.maximum(load.sum(axis=1, keepdims=True), 1e-300)


def _fluid_cv(hk, lk, share) -> np.ndarray:
    """Every module's per-microbatch CV of the loads ``hk + share * lk`` (``hk`` [R, m, K] the
    heavy samples' module loads, ``lk`` [R, K] the light work's totals): [R, K] for ``share``
    [R, m], [R, P, K] for P profiles of each row, ``share`` [R, P, m].

    From the centred moments (the heavy loads' variance, their covariance with the shares,
    the shares' variance), which need no [R, P, m, K] loads: the descent prices ~100 probes a
    step, and building their loads took it 1.7 ms a step at 8192 / dp 128 (the light work's
    largest cost on light-tailed rows). Centred, so nearly even loads keep their small CV
    (``tests/test_assignment_light_work.py`` holds it to :func:`.common.module_cv` of the
    built loads). The sums over microbatches run in index order, as the compiled descent
    (:func:`.fluid_kernel.fluid_descent`) runs them."""
    probes = share.ndim == hk.ndim  # [R, P, m]: the row's statistics broadcast over P
    at = (slice(None), None) if probes else (slice(None),)
    m = share.shape[-1]
    hc, hh, hm = _heavy_moments(hk)
    s1 = _sum_last(share) / m
    sc = share - s1[..., None]
    cov = sc[..., 0, None] * hc[:, 0][at]  # not a matrix product: its order is the BLAS's
    for j in range(1, m):
        cov = cov + sc[..., j, None] * hc[:, j][at]
    lk = lk[at]
    ss = _sum_last(sc * sc) / m
    var = hh[at] + 2.0 * lk * (cov / m) + lk * lk * ss[..., None]
    mean = hm[at] + lk * s1[..., None]
    std = np.sqrt(np.maximum(var, 0.0))
    return np.where(mean > 0, std / np.where(mean > 0, mean, 1.0), 0.0)


def _heavy_moments(hk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The heavy loads' moments :func:`_fluid_cv` reads (``hk`` [R, m, K]): centred [R, m, K],
    their mean square [R, K] and their mean [R, K]; the compiled descent takes the same."""
    hc = hk - hk.mean(axis=-2, keepdims=True)
    return hc, (hc * hc).mean(axis=-2), hk.mean(axis=-2)


def _sum_last(x: np.ndarray) -> np.ndarray:
    """``x`` summed over its last axis in index order (numpy's sum adds in blocks)."""
    out = x[..., 0]
    for j in range(1, x.shape[-1]):
        out = out + x[..., j]
    return out


def _towards(now, free, hk, lk, aim) -> np.ndarray:
    """[r, m] the point furthest from ``now`` towards ``free`` whose fluid CVs stay within
    ``aim`` (bisection: the CV bound is convex in the shares and ``now`` is within it, so the
    points within it form one stretch of the line)."""

    def fine(t):  # [r] the point at t [r] within the bound
        return (_fluid_cv(hk, lk, now + t[:, None] * (free - now)) <= aim + 1e-12).all(axis=1)

    lo, hi = fine(np.ones(len(now))).astype(np.float64), np.ones(len(now))
    for _ in range(_BISECTIONS):  # where the free profile is within, lo = hi = 1 stays
        t = (lo + hi) / 2
        ok = fine(t)
        lo, hi = np.where(ok, t, lo), np.where(ok, hi, t)
    return now + lo[:, None] * (free - now)


def _within(sub: Replicas, es, ls, limit) -> np.ndarray:
    """[r] every module's per-microbatch CV of the sets within ``limit`` [r, K]."""
    return (module_cv(module_loads(sub, es, ls)) <= limit + 1e-12).all(axis=1)


def _patch_sizes(sub: Replicas) -> np.ndarray:
    """[r, n, E] each sample's patches per encoder as floats (none where it has no encoder
    work: it is never encoded)."""
    return np.where(sub.has_enc[..., None], sub.patches, 0).astype(np.float64)
