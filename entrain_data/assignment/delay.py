"""Opt-in bounded delay (``assign(..., max_delay=K)``): heavy samples wait, then land together.

With many replicas a sample heavier than about half a mean microbatch stalls its
whole iteration wherever it sits: the replica that holds it is the slowest, and
one such sample per iteration costs as much as several. ``wlb_llm`` hides them in
an unbounded outlier queue; here a sample waits at most ``K`` iterations:

- *heavy*: on some module (each encoder column, the LLM) the sample carries more
  than a mean microbatch's load of that module (``HEAVY_SHARE``; lighter samples can
  be balanced in place, and delaying them cost up to 0.5% at 4 samples per microbatch);
- while no heavy sample has waited ``K`` iterations (``ages``, supplied by the
  caller) and fewer heavy samples are present than microbatches in the iteration,
  every heavy sample is carried;
- otherwise all of them are placed in this iteration together, so a few
  iterations carry many heavy samples (level 1 spreads them evenly over the
  replicas, level 2 over the microbatches) and the others none; the count placed
  is rounded up to a multiple of dp where enough heavy samples are present, so
  every replica gets the same number;
- ``flush`` (the last iteration of a run or epoch) places everything.

Every sample is still trained exactly once: the caller prepends the carried
samples to the next global batch with their age plus one (see
``entrain_data/README.md``, "Assignment").
"""

from __future__ import annotations

import numpy as np

from .common import Inputs

__all__ = ["HEAVY_SHARE", "heavy_samples", "delayed_samples"]

HEAVY_SHARE = 1.0  # of a mean microbatch's load on one module (WLB-LLM's rule says 0.5)


def heavy_samples(x: Inputs) -> np.ndarray:
    """[B] bool: the sample carries more than ``HEAVY_SHARE`` of a mean microbatch on a module."""
    w = np.concatenate([x.enc, x.llm[:, None]], axis=1)
    per_mb = w.sum(axis=0) / (x.dp * x.microbatches)
    share = np.where(per_mb > 0, w / np.where(per_mb > 0, per_mb, 1.0), 0.0)
    return share.max(axis=1) > HEAVY_SHARE


def delayed_samples(x: Inputs, flush: bool) -> np.ndarray:
    """Indices (ascending) of the samples of ``x`` that wait for a later iteration."""
    none = np.zeros(0, np.int64)
    if x.max_delay <= 0 or flush:
        return none
    heavy = heavy_samples(x)
    idx = np.flatnonzero(heavy)
    bins = x.dp * x.microbatches
    if len(idx) == 0 or x.n - len(idx) < bins:  # the rest could not fill every microbatch
        return none
    forced = x.ages[idx] >= x.max_delay
    if not forced.any() and len(idx) < bins:
        return idx
    # land together: all heavy samples now, a multiple of dp of them where possible
    down = len(idx) - len(idx) % x.dp
    need = int(forced.sum())
    place = down if need <= down else min(-(-need // x.dp) * x.dp, len(idx))
    # keep the oldest (forced first), then the heaviest
    w = np.concatenate([x.enc, x.llm[:, None]], axis=1)[idx]
    weight = (w / np.maximum(w.mean(axis=0), 1e-30)).sum(axis=1)
    order = np.lexsort((-weight, -x.ages[idx]))
    return np.sort(idx[order[place:]])
