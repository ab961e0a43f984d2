"""Level-2 candidates with light first and last microbatches ("shaped" sets), and co-shaped
ones where a sample outweighs a mean microbatch (:func:`coshaped_candidate`).

1F1B exposes two microbatches: the first one's forward runs alone through every
stage while the pipeline fills, the last one's backward (twice the forward's
work) alone while it drains. Every other microbatch overlaps with work on the
other stages. Equal microbatches therefore do not give the shortest iteration:
moving a share ``a`` of a mean microbatch's work out of the first and the last
one into the ``m - 2`` between them shortens the fill and the drain by about
``a`` of a stage's forward and backward, and lengthens the steady state by
only ``2a / (m - 2)``. On a 4-stage, 16-microbatch proxy pipeline ``a = 0.1``
shortened the iteration by 1.3-2.3% whatever stage was the bottleneck (equal
microbatches reach the usual "ideal" time; these beat it).

Balance stays the contract: the shape's CV is at most ``_SHAPE_SHARE`` of the CV
a random equal-count cut gives (:func:`.common.random_cut_cv`) on every
module it shapes (all of them for joint sets, the LLM alone for deferring ones), so
shaped sets stay several times more even than what ``sequential`` or a cost-blind
cut gives; a module that costs the same on every sample is never shaped (its sets
would become uneven where any equal-count cut keeps them even). A replica holding
a sample heavier than a mean microbatch is not shaped either: its iteration is set
by that sample, and the proxy pipeline is least faithful there (measured:
real:sroie-docs/vla-3b at 512 / dp 4 lost 1.3% when shaped). :func:`.entrain._pick`
takes a shaped candidate only where the proxy pipeline rates it at least
``_SHAPE_GAIN`` faster than the best even one.
"""

from __future__ import annotations

import numpy as np

from .common import (
    Candidate,
    Replicas,
    module_cv,
    mountain_positions,
    random_cut_cv,
    slot_sums,
)
from .encoder_sets import refine_vector
from .llm_sets import fits_cap, llm_sets_fill, repair_joint
from .pipeline_search import outliers

__all__ = ["coshaped_candidate", "edge_shape", "shape_amplitudes", "shaped_candidates"]

_SHAPE_SHARE = 0.25  # the shape's CV, at most this share of a random cut's (each module it shapes)
_SHAPE_MAX = 0.3  # and the edges never below 0.7 of a mean microbatch
_SCALES = (1.0, 0.5)  # candidates at these shares of the largest allowed amplitude
# co-shaped sets: a column follows the forced profile by at most this share of its random
# cut's CV (the straggler rule's bound, entrain._STRAGGLER_CV)
_COSHAPE_CV = 0.75
_CAP_AIM = 0.9  # co-shaped sets aim a microbatch's tokens at no more than this share of the cap
_LEVEL_FLOOR = 0.05  # and every microbatch at least this share of a mean one of every module


def edge_shape(m: int) -> np.ndarray:
    """[m] the shape's direction: -1 at the first and last microbatch, the work they give
    up spread evenly over the others (sums to zero; all zeros below 3 microbatches)."""
    shape = np.zeros(m)
    if m >= 3:
        shape[[0, -1]] = -1.0
        shape[1:-1] = 2.0 / (m - 2)
    return shape


def shape_amplitudes(rp: Replicas) -> tuple[np.ndarray, np.ndarray]:
    """[R] the largest share of a mean microbatch each replica's edges may give up, with
    every module shaped, and with the LLM sets alone."""
    m, valid = rp.m, rp.valid
    r_count = valid.shape[0]
    unit = float(edge_shape(m).std())
    if unit <= 0:
        return np.zeros(r_count), np.zeros(r_count)
    cost = rp.module_costs  # [R, n, K]
    c = np.where(valid[..., None], cost, 0.0)
    used = c.sum(axis=1) > 0  # [R, K] modules with work on this replica
    rc = np.where(used, rp.cut_cv, np.inf)
    outlier = outliers(c, m).any(axis=1)

    def amplitude(rc_min: np.ndarray) -> np.ndarray:
        rc_min = np.where(np.isfinite(rc_min), rc_min, 0.0)
        amp = np.minimum(_SHAPE_SHARE * rc_min / unit, _SHAPE_MAX)
        return np.where(outlier, 0.0, amp)

    return amplitude(rc.min(axis=1)), amplitude(rc[:, -1])


def shaped_candidates(
    rp: Replicas,
    vector_sets: np.ndarray,
    wv: tuple[np.ndarray, np.ndarray],
    deferring_order: np.ndarray,
    tolerance: float,
    refine_iters: int,
) -> list[Candidate]:
    """Shaped variants of two even candidates, each with its ``profile`` (the per-microbatch
    load share every module is balanced against):

    - joint sets (E = L): the vector candidate's sets (``vector_sets`` over ``wv``, its
      columns and their weights) refined toward the shaped per-bin targets (``refine_iters``
      steps) and repaired under the caps, every module shaped;
    - deferring sets: the LLM sets filled toward the shaped running target on the
      encoder sets ``deferring_order`` (LLM-heaviest first: the most room to shape), the
      LLM shaped, the encoder sets as they are (so only the LLM's random-cut CV bounds
      the shape: an encoder that costs the same on every sample does not forbid it).
    """
    m, valid = rp.m, rp.valid
    r_count = valid.shape[0]
    k_count = rp.module_costs.shape[2]
    if m < 3:
        return []
    amp, amp_llm = shape_amplitudes(rp)
    shape = edge_shape(m)[None, :]
    out = []
    for scale in _SCALES:
        if (amp > 0).any():
            prof = 1.0 + (scale * amp)[:, None] * shape  # [R, m]
            joint = vector_sets.copy()
            refine_vector(joint, wv[0], valid, m, iters=refine_iters, profile=prof, weight=wv[1])
            joint = repair_joint(rp, joint, *wv)
            every = np.repeat(prof[..., None], k_count, axis=2)
            # replicas without room keep the even candidates
            out.append(Candidate(joint, joint, (amp <= 0) | ~fits_cap(rp, joint), every))
        if (amp_llm > 0).any():
            prof = 1.0 + (scale * amp_llm)[:, None] * shape
            c = llm_sets_fill(rp, deferring_order, tolerance, prof)
            llm = np.concatenate([np.ones((r_count, m, k_count - 1)), prof[..., None]], axis=2)
            out.append(Candidate(c.eidx, c.lidx, (amp_llm <= 0) | c.failed, llm))
    return out


def coshaped_candidate(
    rp: Replicas, vector_sets: np.ndarray, wv: tuple[np.ndarray, np.ndarray], refine_iters: int
) -> Candidate | None:
    """Joint sets on replicas holding a sample heavier than a mean microbatch, every module
    following the profile those samples force, heaviest microbatches in the middle (None
    where no replica holds one).

    Such a sample makes its microbatch heavy on its module whatever the cut. Sets balanced
    column by column then give that microbatch less of every other module, so the stages
    take turns as the bottleneck: while the heavy microbatches pass, the encoder stages
    run 1.3-1.6x a mean microbatch and the LLM stage 1.0-1.1x, and the reverse after. When
    every module follows the same profile the stages stay in step (measured, 4096 / dp 16 /
    32, ``qwen2vl-dynamic`` on three encoder stages and one LLM stage: 12.17 s for the
    column-balanced sets, 11.54 s for these, 11.83 s for ``verl_kk``'s).

    The profile is the least uneven one whole samples allow the module whose largest sample
    is the heaviest against a mean microbatch (the driver): each sample heavier than the
    even share of what is left alone in a microbatch, the rest even (:func:`_water_levels`),
    the highest level on the set that holds the most of the driver. Every other column follows
    it as far as its own samples vary: its profile's CV is at most ``_COSHAPE_CV`` of the
    CV a random equal-count cut of its samples gives, so no module ends less even than a
    cost-blind cut leaves it, and a column that costs the same on every sample (every clip
    padded to 30 s) stays even, and no microbatch's tokens are aimed past ``_CAP_AIM`` of
    the token cap. The sets are then refined toward those profiles on every column of ``wv``
    (``refine_iters`` steps) and repaired under the caps (the token aim keeps the repair
    short: without it the exchanges took 20 ms an assignment at 8192 / dp 128; without any
    repair the heavy microbatches break the patch cap and most replicas lose these sets).
    A replica does not take them where a cap still breaks, or where a module other than the
    driver ends less even than a random cut.
    """
    m, valid = rp.m, rp.valid
    cost = np.where(valid[..., None], rp.module_costs, 0.0)  # [R, n, K]
    mean_mb = cost.sum(axis=1) / m  # [R, K]
    ratio = np.where(mean_mb > 0, cost.max(axis=1) / np.where(mean_mb > 0, mean_mb, 1.0), 0.0)
    rows = np.flatnonzero(ratio.max(axis=1) > 1.0)
    if m < 3 or len(rows) == 0:
        return None
    sub = rp.take(rows)
    driver = ratio[rows].argmax(axis=1)
    dc = np.take_along_axis(cost[rows], driver[:, None, None], axis=2)[..., 0]  # [r, n]
    level = _water_levels(dc, m)  # [r, m] descending: what the heavy samples force
    drive = slot_sums(vector_sets[rows], dc, sub.valid, m)  # the driver's load per set
    prof = np.empty_like(level)  # the heaviest set gets the highest level, and so on
    np.put_along_axis(prof, np.argsort(-drive, axis=1, kind="stable"), level, axis=1)
    prof /= prof.mean(axis=1, keepdims=True)
    # a driver with fewer samples than microbatches leaves levels at zero: every set keeps
    # a little of every module (and the pick's score divides by the profile)
    prof = np.maximum(prof, _LEVEL_FLOOR)
    prof /= prof.mean(axis=1, keepdims=True)
    cols, weight = wv  # the first K columns are the modules of ``module_costs``, in order
    # how far each column follows: its random cut's CV (times 3/4) over the profile's
    spread = np.maximum(prof.std(axis=1), 1e-12)[:, None]  # [r, 1]
    # [r, D]: the modules' (as ``rp`` has them) and the rest's, read with the last module's
    # column: numpy sums one column pairwise but several each in order, as on all D at once
    k_count = cost.shape[2]
    rest = random_cut_cv(cols[rows][..., k_count - 1 :], sub.valid, m)[:, 1:]
    rc = np.concatenate([rp.cut_cv[rows], rest], axis=1)
    follow = np.clip(_COSHAPE_CV * rc / spread, 0.0, 1.0)
    np.put_along_axis(follow, driver[:, None], 1.0, axis=1)  # the driver's shape is forced
    prof_cols = 1.0 + follow[:, None, :] * (prof - 1.0)[..., None]  # [r, m, D]
    if rp.cap is not None:  # never aim a microbatch's tokens (the last column) past the cap
        mean_tok = sub.tok.sum(axis=1) / m
        room = rp.cap / np.where(mean_tok > 0, mean_tok, 1.0)
        tok_prof = np.minimum(prof_cols[..., -1], _CAP_AIM * room[:, None])
        prof_cols[..., -1] = tok_prof / tok_prof.mean(axis=1, keepdims=True)
    joint = vector_sets[rows].copy()
    refine_vector(
        joint, cols[rows], sub.valid, m, iters=refine_iters, profile=prof_cols, weight=weight
    )
    joint = repair_joint(sub, joint, cols[rows], weight)
    # heaviest in the middle: 1F1B runs the first forward and the last backward alone
    newpos = mountain_positions(prof)
    joint = np.where(sub.valid, np.take_along_axis(newpos, np.maximum(joint, 0), axis=1), -1)
    prof_new = np.empty_like(prof_cols)
    np.put_along_axis(prof_new, newpos[..., None], prof_cols, axis=1)
    eidx = np.full_like(vector_sets, -1)
    eidx[rows] = joint
    # a module other than the driver less even than a random cut leaves it: not these sets
    # (a column near a count, every clip padded to 30 s, cannot follow a transcript's shape)
    cv = module_cv(slot_sums(joint, cost[rows], sub.valid, m))  # [r, K]
    uneven = cv > rc[:, :k_count] + 1e-12
    np.put_along_axis(uneven, driver[:, None], False, axis=1)
    failed = np.ones(valid.shape[0], bool)
    failed[rows] = ~fits_cap(sub, joint) | uneven.any(axis=1)
    profile = np.ones((valid.shape[0], m, k_count))
    profile[rows] = prof_new[..., :k_count]
    return Candidate(eidx, eidx, failed, profile)


def _water_levels(cost: np.ndarray, m: int) -> np.ndarray:
    """[R, m] per-microbatch loads, descending, of the most even split of each row's
    ``cost`` [R, n] into ``m`` microbatches that keeps samples whole, samples taken apart:
    a sample heavier than an even share of what remains fills a microbatch alone, the rest
    is spread evenly (the water-filling lower bound on every microbatch's load)."""
    items = -np.sort(-cost, axis=1)
    r_count, n = items.shape
    out = np.zeros((r_count, m))
    rest = items.sum(axis=1)
    open_rows = np.ones(r_count, bool)
    for k in range(m):
        share = rest / (m - k)
        item = items[:, k] if k < n else np.zeros(r_count)
        alone = open_rows & (item > share)
        out[alone, k] = item[alone]
        rest = np.where(alone, rest - item, rest)
        done = open_rows & ~alone
        out[done, k:] = share[done, None]
        open_rows &= alone
    return out
