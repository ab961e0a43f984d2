"""Level-2 candidates with light first and last microbatches ("shaped" sets).

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
a random equal-count cut gives (:func:`.pipeline_search.random_cut_cv`) on every
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

from .common import Candidate, Replicas
from .encoder_sets import refine_vector
from .llm_sets import fits_cap, llm_sets_fill, repair_joint
from .pipeline_search import random_cut_cv

__all__ = ["edge_shape", "shape_amplitudes", "shaped_candidates"]

_SHAPE_SHARE = 0.25  # the shape's CV, at most this share of a random cut's (each module it shapes)
_SHAPE_MAX = 0.3  # and the edges never below 0.7 of a mean microbatch
_SCALES = (1.0, 0.5)  # candidates at these shares of the largest allowed amplitude


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
    rc = np.where(used, random_cut_cv(cost, valid, m), np.inf)
    mean_mb = c.sum(axis=1) / m
    outlier = (c.max(axis=1) > np.where(used, mean_mb, np.inf)).any(axis=1)

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
