"""Opt-in bounded delay (``assign(..., max_delay=K)``): heavy samples wait, then land together.

With many replicas a sample heavier than about half a mean microbatch stalls its
whole iteration wherever it sits: the replica that holds it is the slowest, and
one such sample per iteration costs as much as several. ``wlb_llm`` hides them in
an unbounded outlier queue; here a sample waits at most ``K`` iterations.

Which samples may wait (:func:`delayed_samples`, one rule per share in ``SHARES``):

- *heavy*: on some module (each encoder column, the LLM) the sample carries more
  than ``share`` of a mean microbatch's load of that module;
- while no heavy sample has waited ``K`` iterations (``ages``, supplied by the
  caller) and fewer heavy samples are present than microbatches in the iteration,
  every heavy sample is carried;
- otherwise they are placed in this iteration together, so a few iterations
  carry many heavy samples (level 1 spreads them evenly over the replicas, level 2
  over the microbatches) and the others none. Where one has waited K iterations
  all of them land: one kept back would force the next landing sooner (with K = 2
  two iterations later instead of three), and every landing pays the stall of its
  heaviest sample again (frozen common-voice-ps at 512 / dp 4: landings at
  iterations 2, 3 and 6 of 8 where 2 and 5 suffice). Where there are more heavy
  samples than microbatches every iteration lands: a multiple of the microbatch
  count is placed (as many in every microbatch; a multiple of dp left some
  microbatches two, sroie-docs with frozen encoders at 8192 / dp 32 / 32 0.998 of
  ``wlb_llm``, 1.004 so), the youngest and lightest of the rest wait;
- ``flush`` (the last iteration of a run or epoch) places everything.

Whether they wait (:func:`assign_delayed`) is priced, not assumed: waiting pays only
where the heavy samples make stragglers. Where they are a large share of the work
(document pages, long audio) carrying them only moves that work to the iteration
they land in, whose module mix it skews (sroie-docs with frozen encoders at 512 /
dp 4: 3% slower than not delaying). Each option is assigned and its cost is this
iteration's proxy 1F1B time plus what the carried samples add to a batch like this
one (the batch with copies of them appended, assigned the same way); the
cheapest wins, an option that carries only where it is ``GAIN`` cheaper than the
cheapest before it (no delay first). Where no delay cannot meet a cap, the options
that can are ranked by this iteration's time alone. Every option, its landing and a
landing iteration itself are priced on one pipeline: the plan's stages where the caller
told them (``stage_shares``), else the stages the fresh samples' module mix gives
(:func:`fresh_layout`), as the plan's stages stay where they are whatever is carried; where
the depth is not told, on the mean over 2, 4 and 8 stages the sets were hedged on (on the
default depth alone, the light work laid for it made not delaying look cheaper than it ran on
8 stages: `qwen2vl-dynamic`/vla-3b at 512 / dp 4 carried nothing, 0.9753 of `wlb_llm`, where
carrying ran at 1.0748).

Riders (:func:`_with_riders`). A landing stalls on its heavy samples, and with K = 2 a run
lands every third iteration, while ``wlb_llm`` lands its whole queue once, at the end, amid
a batch's light work that fills the stall. Where the winning option carries, :data:`RIDERS` of
the fresh light samples (and the light ones already riding) may wait with the heavy ones:
the iterations between landings lose that light work, the landing gains it where its stages
waited anyway. Priced as the options are (1% cheaper than the winner), and only where a
landing like this batch plus every carried sample fits the caps by the planner's rule, so a
landing up to twice a batch never needs caps the plan did not give (long documents among
short chats: the largest sample sets the cap, a mean set is a fraction of it). Frozen
``mix:chat``/vla-3b at 512 / dp 4: 0.977 -> 1.011 of ``wlb_llm``.

Every sample is still trained exactly once: the caller prepends the carried
samples to the next global batch with their age plus one (see
``entrain_data/README.md``, "Assignment").
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import InvalidInput
from ..token_caps import cap_rule
from .common import Assignment, Inputs, rng_for
from .entrain import assign_entrain, assign_entrain_priced

__all__ = [
    "HEAVY_SHARE",
    "SHARES",
    "assign_delayed",
    "delayed_samples",
    "fresh_layout",
    "heavy_samples",
]

HEAVY_SHARE = 1.0  # of a mean microbatch's load on one module (WLB-LLM's rule says 0.5)
# the heavy rules priced per iteration: ours, and one as wide as WLB-LLM's
SHARES = (HEAVY_SHARE, 0.5)
# an option that waits must be this much cheaper: the landing is an estimate (a batch like
# this one), and at 0.1% it took delays that cost 1-2% (vision-audio at 512 / dp 4)
GAIN = 0.01
# of the fresh light samples, carried along with the heavy ones where that is cheaper (see
# the module docstring: the landing's light work fills the stall of its heavy samples)
RIDERS = 0.5


def heavy_samples(x: Inputs, share: float = HEAVY_SHARE) -> np.ndarray:
    """[B] bool: the sample carries more than ``share`` of a mean microbatch on a module."""
    w = np.concatenate([x.enc, x.llm[:, None]], axis=1)
    per_mb = w.sum(axis=0) / (x.dp * x.microbatches)
    frac = np.where(per_mb > 0, w / np.where(per_mb > 0, per_mb, 1.0), 0.0)
    return frac.max(axis=1) > share


def delayed_samples(x: Inputs, flush: bool, share: float = HEAVY_SHARE) -> np.ndarray:
    """Indices (ascending) of the samples of ``x`` that wait for a later iteration."""
    none = np.zeros(0, np.int64)
    if x.max_delay <= 0 or flush:
        return none
    heavy = heavy_samples(x, share)
    idx = np.flatnonzero(heavy)
    bins = x.dp * x.microbatches
    if len(idx) == 0 or x.n - len(idx) < bins:  # the rest could not fill every microbatch
        return none
    forced = bool((x.ages[idx] >= x.max_delay).any())
    if not forced and len(idx) < bins:
        return idx
    if forced:  # all of them land now: one kept back would force the next landing sooner
        return none
    # more heavy samples than microbatches: they land now, a multiple of the microbatch
    # count (as many in every microbatch, as WLB-LLM's queue releases them), the youngest
    # and lightest of the rest wait (in this regime every iteration is a landing, so
    # waiting moves no landing)
    place = len(idx) - len(idx) % bins
    w = np.concatenate([x.enc, x.llm[:, None]], axis=1)[idx]
    weight = (w / np.maximum(w.mean(axis=0), 1e-30)).sum(axis=1)
    order = np.lexsort((-weight, -x.ages[idx]))
    return np.sort(idx[order[place:]])


def assign_delayed(x: Inputs, seed: int, iteration: int, flush: bool) -> Assignment:
    """Entrain over the samples that stay, the carried set chosen by what it costs (see
    the module docstring); with ``max_delay=0`` plain entrain. Every batch it prices or
    assigns is laid out on :func:`fresh_layout`, but for one of only fresh samples kept
    whole, laid out on its own totals (the same numbers, summed as plain entrain sums them:
    where nothing waits, the assignment is plain entrain's). Told the plan's stages
    (``x.shares``), every batch is priced on those and no layout is derived."""
    if x.max_delay <= 0:
        return assign_entrain(x, seed, iteration)
    # every option, its landing and a landing iteration on the fresh samples' stages; a
    # batch of fresh samples kept whole on its own (the same totals, summed as plain entrain
    # sums them: where nothing waits, max_delay changes nothing)
    laid = x if x.shares is not None else replace(x, layout=fresh_layout(x))
    whole = laid if x.ages is not None and (x.ages > 0).any() else x
    options = [np.zeros(0, np.int64)]
    for sh in SHARES:
        c = delayed_samples(x, flush, sh)
        if not any(np.array_equal(c, o) for o in options):
            options.append(c)
    if len(options) == 1:
        return assign_entrain(whole, seed, iteration)
    best, best_cost, now, error = None, np.inf, None, None
    for carried in options:  # no delay first: ``now`` is its time
        try:
            a, cost = _priced(x, laid, whole, carried, now, seed, iteration)
        except InvalidInput as exc:  # a cap this option (or its landing) cannot meet
            error = error or exc
            continue
        if len(carried) == 0:
            now = cost
        if cost < best_cost * (1 - GAIN):
            best, best_cost = a, cost
    if best is None:
        raise error
    # the winner carries: the landing's light work could fill its stall too (riders)
    ride = None
    if len(best.carried) and now is not None:
        ride = _with_riders(x, best.carried, seed, iteration)
    if ride is not None:
        try:
            a, cost = _priced(x, laid, whole, ride, now, seed, iteration)
        except InvalidInput:  # a cap the riders' option (or its landing) cannot meet
            return best
        if cost < best_cost * (1 - GAIN):
            best = a
    return best


def _priced(x: Inputs, laid: Inputs, whole: Inputs, carried, now, seed: int, it: int):
    """(assignment, cost) of the option that carries ``carried``: this iteration's proxy
    time, plus what the carried samples add to a batch like this one (``now``: its time;
    None where no delay failed a cap: then this iteration's time alone)."""
    keep = np.setdiff1d(np.arange(x.n), carried)
    a, t = assign_entrain_priced(whole if len(carried) == 0 else _rows(laid, keep), seed, it)
    cost = float(t.max())
    if len(carried) and now is not None:  # they land later in a batch like this one
        _, t_land = assign_entrain_priced(
            _rows(laid, np.concatenate([np.arange(x.n), carried])), seed, it
        )
        cost += float(t_land.max()) - now
    enc = [[keep[s] for s in row] for row in a.encoder_sets]
    llm = [[keep[s] for s in row] for row in a.llm_sets]
    return Assignment(a.method, a.dp, a.microbatches, enc, llm, carried), cost


def _with_riders(x: Inputs, carried: np.ndarray, seed: int, iteration: int) -> np.ndarray | None:
    """``carried`` with light samples riding along (indices, ascending): the riders already
    carried (waiting less than ``max_delay``) and :data:`RIDERS` of the fresh light samples
    (seeded draw); None where the rest could not fill every microbatch, or where a landing
    like this batch plus all of them would need larger caps than ``x``'s by the planner's
    rule (:func:`~entrain_data.token_caps.cap_rule`: 1.5x its mean set, the largest sample, a
    replica's share), so that the landing's sets fit the caps the plan gave; where ``x`` has
    none, larger than the rule gives this batch. Riders fit where the largest sample sets
    the cap (long documents among short chats: a mean set is a fraction of it), not where
    1.5x a mean set does (a landing twice a batch needs twice the mean set)."""
    ages = np.zeros(x.n, np.int64) if x.ages is None else x.ages
    light = np.ones(x.n, bool)
    light[carried] = False
    young = light & (ages < x.max_delay)
    fresh = np.flatnonzero(young & (ages == 0))
    drawn = fresh[rng_for(seed, iteration, 4).random(len(fresh)) < RIDERS]
    ride = np.sort(np.concatenate([carried, np.flatnonzero(young & (ages > 0)), drawn]))
    bins = x.dp * x.microbatches
    if len(ride) == len(carried) or x.n - len(ride) < bins:
        return None
    land = np.concatenate([np.arange(x.n), ride])
    sizes = [(x.tokens, x.max_tokens)]
    if x.patches is not None:
        caps = [None] * x.patches.shape[1] if x.patch_cap is None else x.patch_cap
        sizes += [(x.patches[:, e], caps[e]) for e in range(x.patches.shape[1])]
    for size, cap in sizes:
        if _cap_need(x, size[land]) > (_cap_need(x, size) if cap is None else cap):
            return None
    return ride


def _cap_need(x: Inputs, sizes: np.ndarray) -> int:
    """The cap a batch of ``sizes`` (tokens or patches) needs by the planner's rule."""
    return cap_rule(int(sizes.sum()), int(sizes.max(initial=0)), x.dp, x.microbatches)


def fresh_layout(x: Inputs) -> np.ndarray:
    """[E + 1] the module totals (each encoder column, the LLM) of the iteration's fresh
    samples (age 0), the ones the proxy lays its stages out on; the whole batch's where no
    sample is fresh or the fresh ones leave a module the batch uses without work.

    The plan's stages do not move with what is carried. Laid out on each batch's own totals,
    a landing (text-heavy/vla-3b at 512 / dp 4 / 32: 53 long documents carried in) shifted
    the proxy's stages towards the LLM, which the plan's do not do, and was priced at 0.71 of
    the time the bench's simulator ran on the plan's stages (15.9 against 22.4 s); an
    iteration without its documents at 0.89: waiting looked 20% cheaper and ran 7% slower."""
    w = np.concatenate([x.enc, x.llm[:, None]], axis=1)
    whole = w.sum(axis=0)
    fresh = w[x.ages == 0].sum(axis=0) if x.ages is not None else whole
    return fresh if ((fresh > 0) | (whole <= 0)).all() else whole


def _rows(x: Inputs, idx: np.ndarray) -> Inputs:
    """The inputs of the samples ``idx`` of ``x`` (in that order, repeats allowed)."""
    return replace(
        x,
        enc=x.enc[idx],
        llm=x.llm[idx],
        tokens=x.tokens[idx],
        patches=None if x.patches is None else x.patches[idx],
        ages=x.ages[idx],
    )
