"""Entrain's hierarchical microbatch assignment (arXiv 2605.27918, section 4), vectorised.

Level 1 splits the global batch across DP replicas so that every replica's
*vector* of per-module sums (each encoder, the LLM) matches: greedy
largest-first placement in rounds, then pairwise swaps that shrink the worst
relative deviation on any module. With one pipeline stage (``pipeline_stages=1``,
plain data parallelism) every module runs on the same GPU and only a replica's
total work sets its time, so level 1 evens the total instead.

Level 2 composes, inside every replica, M microbatches in two layers:

- encoder sets E_j: longest-processing-time placement of the encoder work, so
  every microbatch carries the same encoder work; the sets are then ordered so
  that early microbatches carry more LLM work than average (their surplus is
  what deferral moves later);
- LLM sets L_j: microbatch by microbatch, pick from the samples encoded so far
  (and the text-only ones) a set whose LLM work meets the running target
  ``remaining / microbatches left``, largest first, under the token cap; the
  rest waits in the encoder-output buffer, whose token total may not exceed the
  deferral budget (the oldest waiting samples are consumed first when it would).
  A second fill on the same encoder sets targets the work that runs with an L set,
  the LLM plus every trainable encoder's backward: the LLM-only fill leaves that
  backward to how many samples each set happens to take.

Samples without encoder work are never buffered: their encoder set is their
LLM set. A replica for which deferral cannot meet the cap or budget falls back
to joint sets (E_j == L_j) packed first-fit-decreasing under the cap, so the
invariants hold for every input the validation accepts, or a clear error says
why the cap cannot be met.

Two more candidates of each kind are *shaped* (:mod:`.shaping`): their first and last
microbatch carry less than a mean one, because 1F1B runs the first one's forward and
the last one's backward alone through the pipeline; equal microbatches cannot reach
that time. The shape's CV is bounded by a quarter of a random cut's, and a shaped
candidate must be 0.3% faster by the proxy to be taken. On replicas holding a sample
heavier than a mean microbatch, one more is *co-shaped*: every module follows the profile
that sample forces on its module, so the stages stay in step instead of taking turns as
the bottleneck (:func:`.shaping.coshaped_candidate`).

At every batch size the chosen sets are then refined against a
simulated 1F1B pipeline (:mod:`.pipeline_search`): whole-sample moves that
shorten a proxy pipeline's iteration while every module's per-microbatch CV
stays within a stated slack of the sets' own (4% encoders, 10% LLM) or within 5% of
what a random equal-count cut would give, whichever is larger
(:func:`.pipeline_search.cv_limits`).

On the slowest replicas, where the plan's depth is told, the light samples are then re-laid
(around the heavy ones, where a replica holds any) on the share profile that is fastest on
the proxy pipeline, free or within a CV bound (:mod:`.light_work`), where that is faster,
every module stays within a random cut's CV and the batch's largest sets within its peaks.
Last, the slowest replicas' microbatches are put in the order that is fastest on the proxy
pipeline, by swaps of whole slots that keep every set, the release and the budget
(:mod:`.slot_order`). Where the depth is not told, the light work is fitted on 4 stages
(then the slot order) and on 8, and a replica takes a fit only where none of 2, 4 and 8
stages runs it slower (:func:`_shaped_untold`).

Level 1 evens the replicas' module sums, but a replica holding a sample several times a
mean microbatch stalls 1F1B and runs longer than its sums say. After level 2 such a replica
gives some of its other samples to the replicas with room (proxy time below the mean), its
sets are rebuilt and the receivers put each sample in their lightest set; kept only where
the slowest replica gets faster and every module's batch-wide CV stays within its limit
(:mod:`.stall_shed`); then again, up to :data:`_SHED_PASSES` rounds, while a round moved work
(the next slowest replica may stall too). Sample counts per replica may then differ. With
``max_delay`` > 0 no CV bound holds the shedding back and a replica 1% over the mean gives
work (time is that option's contract).

The levels live in modules of their own: :mod:`.replica_split` (level 1),
:mod:`.encoder_sets` (E_j), :mod:`.llm_sets` (L_j) and :mod:`.pipeline_search`;
this module builds the level-2 candidates, scores them and picks one per replica:
among the candidates balanced within a stated share of the best (the sum of squared
per-module CVs), the one with the shortest proxy 1F1B iteration
(:func:`.pipeline_search.proxy_times`), or one balanced in absolute terms (every CV
small) where it is more than 1% faster (see :func:`_pick`). Balance first is right for
every replica but the slowest, which set the iteration time: a replica slower than the
slowest one's best reach takes the best-balanced candidate that reaches it, every
module's CV within 3/4 of a random cut's or (the depth known) at the least any candidate
reaches (:func:`_stragglers`). There is no batch-size threshold: every size builds every
candidate and runs the search (vectorised over replicas; the search's work is bounded
at any dp: with many replicas it searches the slowest ones, which set the iteration
time, see :func:`.pipeline_search.refine_slowest`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from .common import (
    Assignment,
    Candidate,
    Inputs,
    Replicas,
    module_cv,
    module_loads,
    mountain_positions,
    relabel_slots,
    rng_for,
    slot_sums,
)
from .encoder_sets import (
    lpt_bins,
    order_by_llm,
    order_mountain,
    refine_bins,
    refine_vector,
    vector_bins,
)
from .light_work import lay_light_work
from .llm_sets import (
    empty_llm_set,
    ffd_joint,
    fits_cap,
    fits_patches,
    llm_sets_fill,
    llm_sets_lpt,
    repair_joint,
)
from .pipeline_search import (
    SEARCH_FOCUS,
    UNKNOWN_DEPTHS,
    depth_blind_pricer,
    proxy_times,
    refine_slowest,
    stage_costs,
    stage_rows,
)
from .replica_split import fit_caps, norm_columns, split_replicas
from .shaping import coshaped_candidate, shaped_candidates
from .slot_order import order_slowest
from .stall_shed import cv_limit, shed_stalls

_SHED_PASSES = 3  # rounds of shed_stalls at most; each runs only where the last one moved work:
# real:common-voice-ps at 8192 / dp 128 0.4% faster (the rest of the bench unchanged)

# (ef, lf, lb) [R, n, S] of pipeline_search.stage_costs
StageCosts = tuple[np.ndarray, np.ndarray, np.ndarray]

__all__ = ["assign_entrain", "assign_entrain_priced", "split_replicas", "lpt_bins", "replicas_of"]

_MOUNTAIN = True
# candidates whose balance score is within this share of the best are ranked by proxy time
_TIME_PICK_SLACK = 0.6
_EDGE_WEIGHT = 0.05  # 1F1B fill/drain: a heavy first or last microbatch costs the whole pipe
_ENC_SLACK = 0.10  # a candidate's encoder CV may exceed the LPT sets' by this share
# A candidate outside those bands but balanced in absolute terms (every CV small) wins where
# it is this much faster by the proxy: squared CVs of 0.001 and 0.002 differ by 100% and both
# are far below what a GPU's kernel-time jitter resolves (text-heavy/vl-1b at 4096 / dp 16 paid
# 3.4% of its iteration time for the difference)
_TIME_GAIN = 0.01
_GOOD_SCORE = 0.005  # balanced enough: a root-sum-square CV over the modules of 0.07
_GOOD_ENC_CV = 0.02  # and every encoder column's CV at most this
# the second joint vector candidate weighs every encoder column this many times the LLM
# and tokens: where encoder work is a count (every clip padded to 30 s) the first one
# evens the LLM at the encoder's cost, deferral evens both but piles encoder backward
# into the last L sets (common-voice-ps at 4096 / dp 16: 1.5% slower than either). At 4x
# its encoder sets stayed 1.5x less even than the LPT sets on such counts (0.030 against 0.020
# on a slow replica of common-voice-ps, 4096 / dp 16, seed 5), outside the pick's bands: at
# 16x they reach the LPT sets' and that row goes 0.998 -> 1.008 of the best keeping peer
_ENC_FIRST = 16
# a replica slower than the others can be may take a less even candidate, each module's
# CV within this share of a random equal-count cut's (see _stragglers)
_STRAGGLER_CV = 0.75
# ... "slower" counted from up to this share below the slowest replica's best reach, times the
# share of replicas a pass of the pipeline search leaves out (see _stragglers)
_SEARCH_GAIN = 0.02
# with several encoders their summed load is a module (Replicas.module_costs): the vector
# candidates count its squared deviation this many times a column's (at 1 the sum of two
# near-constant encoders stayed 0.036 against sequential's 0.019, at 4 0.009-0.012)
_TOTAL_WEIGHT = 4
_VECTOR_ROUNDS = 4  # refine_vector steps per microbatch on the vector candidate
# a shaped candidate (light first and last microbatch, :mod:`.shaping`) must be this much
# faster by the proxy than the best even one: below it, even sets are worth more than
# a gain the proxy pipeline may not resolve
_SHAPE_GAIN = 0.003


def _score(loads: np.ndarray, profile=None, cv=None):
    """[R] how unbalanced a candidate is: the sum over modules (each encoder from E, the
    LLM from L) of the squared CV of per-microbatch load (``loads`` [R, m, K],
    :func:`.common.module_loads`), plus the worst peak/mean as a small tie-break. Squared CVs
    favour candidates with no badly balanced module. A shaped candidate's loads are
    measured against its ``profile`` [R, m, K] (the shape it aims at). Also returns the
    worst encoder column's CV (encoder balance comes first). ``cv``: :func:`.common.module_cv`
    of ``loads`` where the caller has it (an even candidate's CVs are the score's)."""
    r_count = loads.shape[0]
    if profile is not None:  # balance against the intended shape
        loads, cv = loads / profile, None
    mean = loads.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    if cv is None:
        cv = np.where(mean > 0, loads.std(axis=1) / safe, 0.0)  # [R, K]
    edge = np.maximum(loads[:, 0], loads[:, -1]) / safe - 1.0
    edge = np.where(mean > 0, np.maximum(edge, 0.0), 0.0)
    worst = np.where(mean > 0, loads.max(axis=1) / safe, 1.0).max(axis=1)
    score = (cv**2).sum(axis=1) + _EDGE_WEIGHT * edge.mean(axis=1)
    enc_cv = cv[:, :-1].max(axis=1) if cv.shape[1] > 1 else np.zeros(r_count)
    return score + 1e-3 * worst, enc_cv


def replicas_of(x: Inputs, members: np.ndarray) -> Replicas:
    """Level 1's member matrix with every per-member array level 2 reads."""
    return replica_builder(x)(members)


def replica_builder(x: Inputs) -> Callable[[np.ndarray], Replicas]:
    """``build(members) -> Replicas`` of ``x``'s samples (:func:`replicas_of`): the
    per-sample columns are laid out once, with a row of zeros after the last sample that
    every pad reads, so a build is one ``take`` per array. The stall shedding builds the
    replicas again after every share it tries: at 65536 / dp 1024 a build's gathers and masks
    cost 9 ms (80 ms of ``real:common-voice-ps``'s assignment), its takes 0.8 ms."""
    e_count = x.enc.shape[1]
    patches = np.zeros((x.n, e_count), np.int64) if x.patches is None else x.patches
    # a sample with patches is encoded, and its patches count, even where a frozen or
    # cheap encoder prices it at 0
    has_enc = (x.enc.sum(axis=1) > 0) | (patches.sum(axis=1) > 0)
    columns = (x.enc, norm_columns(x.enc).sum(axis=1), x.llm, x.tokens, patches, has_enc)
    padded = [np.concatenate([c, np.zeros((1,) + c.shape[1:], c.dtype)]) for c in columns]
    enc, enc_w, llm, tok, pat, has = padded

    def build(members: np.ndarray) -> Replicas:
        valid = members >= 0
        at = np.where(valid, members, x.n)  # pads read the row of zeros
        return Replicas(
            members=members,
            valid=valid,
            has_enc=np.take(has, at),
            enc_cols=np.take(enc, at, axis=0),
            enc_w=np.take(enc_w, at),
            llm=np.take(llm, at),
            tok=np.take(tok, at),
            patches=np.take(pat, at, axis=0),
            m=x.microbatches,
            cap=x.max_tokens,
            budget=x.defer_budget,
            patch_cap=x.patch_cap,
            frozen=x.frozen,
            stages=x.stages,
            depth_known=x.depth_known,
            layout=x.layout,
            shares=x.shares,
        )

    return build


def assign_entrain(x: Inputs, seed: int, iteration: int, tolerance: float = 0.02) -> Assignment:
    """Entrain's two-level assignment of ``x`` (see the module docstring): the same
    candidates and the same search at every batch size."""
    return _assign(x, seed, iteration, tolerance)[0]


def assign_entrain_priced(
    x: Inputs, seed: int, iteration: int, tolerance: float = 0.02
) -> tuple[Assignment, np.ndarray]:
    """:func:`assign_entrain` and every replica's proxy 1F1B iteration time [R] for it (in
    the units of ``x``'s costs): ``max_delay`` prices the iterations it could build."""
    a, rp, eidx, lidx = _assign(x, seed, iteration, tolerance)
    if not rp.depth_known:  # hedged as the sets were (untold, the default depth's proxy
        # priced the light work laid for it only: it stopped carrying what ran faster carried)
        return a, depth_blind_pricer(rp)(eidx, lidx, in_work=True)
    return a, proxy_times(rp, eidx, lidx)


def _assign(x: Inputs, seed: int, iteration: int, tolerance: float):
    """The assignment with the level-1 replicas and level-2 slots it came from."""
    rng = rng_for(seed, iteration, 1)
    cols = np.concatenate([x.enc, x.llm[:, None]], axis=1)
    if x.stages == 1:  # one stage runs every module: only the replica's total work counts
        cols = cols.sum(axis=1, keepdims=True)
    else:  # an encoder without work in this batch is no module
        cols = cols[:, np.append(cols[:, :-1].any(axis=0), True)]
    w = norm_columns(cols)
    replicas = replica_builder(x)
    rp = replicas(fit_caps(split_replicas(w, x.dp, rng, microbatches=x.microbatches), x, w))
    stage = stage_costs(rp)  # the proxy's per-sample stage costs, read by every step
    eidx, lidx = _level2(rp, tolerance, stage, rng_for(seed, iteration, 2))

    def level2(rp2: Replicas, stage2: StageCosts, rows: np.ndarray):
        sub, st = rp2.take(rows), stage_rows(stage2, rows)
        return _level2(sub, tolerance, st, rng_for(seed, iteration, 3))

    limit = None  # every round's balance bound: the first round's (sets before any shedding)
    for _ in range(_SHED_PASSES):  # again while it pays: the next slowest may stall too
        rp2, e2, l2, st2 = shed_stalls(x, rp, eidx, lidx, stage, replicas, level2, limit)
        if rp2 is rp:
            break
        if limit is None:
            limit = cv_limit(rp, eidx, lidx)
        rp, eidx, lidx, stage = rp2, e2, l2, st2
    a = _to_assignment("entrain", rp.members, rp.valid, eidx, lidx, x.dp, rp.m)
    return a, rp, eidx, lidx


def _level2(
    rp: Replicas, tolerance: float, stage: StageCosts, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Level 2 of ``rp``: the picked candidate per replica, the heaviest microbatches moved to
    the middle (:func:`_edges_light`), then the pipeline search (:func:`.refine_slowest`).

    The reorder weighs a sample by its work on the proxy's stages (a frozen encoder by its
    forward alone, where the modules' normalised costs summed weighed it as a trainable
    one). It is a rule of thumb, and the pick priced the candidate's own order: the search
    from the reorder mostly ends faster than from that order (qwen2vl-dynamic/vla-3b with
    frozen encoders at 512 / dp 4: 2.3% by the proxy, 2.4% in the bench), but not always (a
    captions mix, COCO and LLaVA with frozen encoders at 512 / dp 4: the reorder cost 2% by
    the proxy, the search won back half, 0.999 of verl_kk). Where the own order beats the
    search's result the replica keeps its own order (searching it as well added 5-7 ms an
    assignment at 8192 / dp 128 for 0.2% on that mix). Last, the light work of the slowest
    replicas is laid on the pipeline's fluid profile (:mod:`.light_work`), and the slowest
    replicas' slots are reordered (:mod:`.slot_order`)."""
    eidx, lidx, keep = _pick(_candidates(rp, tolerance, stage), rp, stage)
    work = sum(s.sum(axis=2) for s in stage)  # [R, n] a sample's work on the proxy's stages
    e_m, l_m = _edges_light(eidx, lidx, rp.valid, work, rp.m, keep)
    e_s, l_s = refine_slowest(rp, e_m, l_m, rng, stage)
    t_pick, t_s = proxy_times(rp, eidx, lidx, stage), proxy_times(rp, e_s, l_s, stage)
    won = t_pick < t_s
    eidx, lidx = np.where(won[:, None], eidx, e_s), np.where(won[:, None], lidx, l_s)
    cur = np.where(won, t_pick, t_s)
    if rp.depth_known:
        eidx, lidx = lay_light_work(rp, eidx, lidx, stage, cur, rng)
        return order_slowest(rp, eidx, lidx, stage)
    return _shaped_untold(rp, eidx, lidx, stage, cur, rng)


def _shaped_untold(rp: Replicas, eidx, lidx, stage: StageCosts, cur, rng):
    """Given no depth, the light work of the slowest replicas laid out as told, once on the
    default depth's proxy (``stage``, ``cur`` its times; then their slot order) and once on
    the deepest of :data:`.pipeline_search.UNKNOWN_DEPTHS`; a replica takes the layout whose
    mean price over those depths is lowest (:func:`.pipeline_search.depth_blind_pricer`),
    and only where no depth runs it slower than its sets did. "Slowest" is by that mean
    price, and a fit is not laid where its own depth's iteration cannot get shorter
    (:mod:`.light_work`'s room). A profile fitted to one depth's fill and drain often suits
    the others, and where it does not, the other fit often does: at 512 / dp 4 / 32 untold,
    the balance bench's mean against the best keeping peer went 1.0250 -> 1.0374 run on 4
    stages, 1.0165 -> 1.0409 on 8 (fitted on 4 alone: 1.0368, 1.0268; kept on the mean
    alone, two rows below 1.000 on 8; the slot order after the deeper fit too: 1.0376,
    1.0423, for 15-25 more ms an assignment at 8192 / dp 128; slowest by each depth's own
    proxy: the same at 512 / dp 4, 9 more ms at 8192 / dp 128)."""
    price = depth_blind_pricer(rp)
    old = price(eidx, lidx, per_depth=True)
    best_e, best_l, best = eidx, lidx, old.mean(axis=0)
    for d in dict.fromkeys((rp.stages, max(UNKNOWN_DEPTHS))):
        told = replace(rp, depth_known=True, stages=d)
        st = stage if d == rp.stages else stage_costs(told)
        now = cur if d == rp.stages else proxy_times(told, eidx, lidx, st)
        e2, l2 = lay_light_work(told, eidx, lidx, st, now, rng, rank=best)
        if d == rp.stages:
            e2, l2 = order_slowest(told, e2, l2, st)
        if np.array_equal(e2, eidx) and np.array_equal(l2, lidx):
            continue
        new = price(e2, l2, per_depth=True)
        mean = new.mean(axis=0)
        better = (mean < best * (1 - 1e-9)) & (new <= old).all(axis=0)
        best_e = np.where(better[:, None], e2, best_e)
        best_l = np.where(better[:, None], l2, best_l)
        best = np.where(better, mean, best)
    return best_e, best_l


def _candidates(rp: Replicas, tolerance: float, stage: StageCosts) -> list[Candidate]:
    """Every level-2 candidate; :func:`_pick` chooses one per replica. ``stage``: the
    (ef, lf, lb) of :func:`.pipeline_search.stage_costs`."""
    m, has_enc, valid = rp.m, rp.has_enc, rp.valid
    # candidate A: encoder sets by LPT over encoder work alone, LLM sets by deferral
    ebin = lpt_bins(rp.enc_w, has_enc, m)
    per_bin = rp.members.shape[1] / m
    refine_bins(ebin, rp.enc_w, has_enc, m, iters=2 * m if per_bin <= 16 else max(4, m // 2))
    eidx = (
        order_mountain(ebin, has_enc, rp.enc_w, rp.llm, m)
        if _MOUNTAIN
        else order_by_llm(ebin, has_enc, rp.llm, m)
    )
    cands = [llm_sets_lpt(rp, eidx), llm_sets_fill(rp, eidx, tolerance)]
    # the same encoder sets without deferral (L = E; text-only samples where the first
    # candidate put them): the reference every deferring candidate competes with
    joint = np.where(has_enc, eidx, cands[0].lidx)
    no_slot = (valid & (joint < 0)).any(axis=1)
    cands.append(Candidate(joint, joint, no_slot | ~fits_cap(rp, np.where(valid, joint, -1))))
    # the same encoder sets, LLM-heaviest first: the most room for deferral
    eidx_d = order_by_llm(np.where(has_enc, eidx, -1), has_enc, rp.llm, m)
    cands.append(llm_sets_fill(rp, eidx_d, tolerance))
    # candidate B: joint sets balancing every encoder column, the LLM and tokens together
    # (vector LPT, then moves and swaps that even every column: refine_vector). Measured
    # over the synthetic workloads at 512/4/32, 4096/16/16 and 8192/128/16, three more
    # candidates (the release-constrained LPT on the LLM-heaviest order and on B's encoder
    # sets, and joint sets balancing the LLM and tokens only) won 2 of 736 replica picks
    # (before refine_vector existed): they are not built.
    wv = _vector_columns(rp, 1)
    vb = _vector_sets(rp, wv)
    cands += shaped_candidates(rp, vb, wv, eidx_d, tolerance, _VECTOR_ROUNDS * m)
    co = coshaped_candidate(rp, vb, wv, _VECTOR_ROUNDS * m)
    if co is not None:
        cands.append(co)
    cands.append(_joint(rp, order_by_llm(vb, valid, rp.llm, m), wv))
    # the same with the encoder columns weighed _ENC_FIRST times (see there)
    wx = _vector_columns(rp, _ENC_FIRST)
    cands.append(_joint(rp, order_by_llm(_vector_sets(rp, wx), valid, rp.llm, m), wx))
    # the deferring sets once more, filled on the work an L set carries: the LLM and the
    # trainable encoders' backward (see _travels_with_l)
    carried = _travels_with_l(rp, stage)
    if carried is not None:
        cands.append(llm_sets_fill(replace(rp, llm=carried), eidx_d, tolerance))
    return cands


def _travels_with_l(rp: Replicas, stage: StageCosts) -> np.ndarray | None:
    """[R, n] the work that runs with a sample's L set on the proxy pipeline (its LLM
    forward and backward, and every trainable encoder's backward: ``stage``'s lf + lb over
    the stages), or None where no trainable encoder carries work.

    The LLM-only fill evens the LLM and leaves the encoder backward to the count of samples
    each L set happens to take: an L set holding one long transcript carries one clip's
    backward, the next one sixteen, and where the encoder holds most stages (Whisper: 3 of
    4 with a 1B LLM) those stages then swing."""
    trainable = rp.enc_cols if rp.frozen is None else rp.enc_cols[..., ~np.asarray(rp.frozen)]
    if not (trainable[rp.valid] > 0).any():
        return None
    _, lf, lb = stage
    return (lf + lb).sum(axis=2)


def _vector_columns(rp: Replicas, times: int) -> tuple[np.ndarray, np.ndarray]:
    """(columns [R, n, D], weight [D]) the vector candidates balance: every encoder column
    counted ``times`` times, with several encoders their sum counted ``_TOTAL_WEIGHT *
    times`` times, the LLM and the tokens once (weights, not copies: a copy costs the set
    builders a column each)."""
    total = [rp.module_costs[..., -2:-1]] if rp.encoders_together else []
    tokf = rp.tok[..., None].astype(np.float64)
    cols = np.concatenate([rp.enc_cols] + total + [rp.llm[..., None], tokf], axis=2)
    weight = np.concatenate(
        [
            np.full(rp.enc_cols.shape[2], float(times)),
            [_TOTAL_WEIGHT * times] * len(total),
            [1.0, 1.0],
        ]
    )
    return cols, weight


def _vector_sets(rp: Replicas, w: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """[R, n] joint sets balancing every column of ``w`` ((columns [R, n, D], weight [D]):
    vector LPT, refined)."""
    cols, weight = w
    bins = vector_bins(cols, rp.valid, rp.m, weight)
    refine_vector(bins, cols, rp.valid, rp.m, iters=_VECTOR_ROUNDS * rp.m, weight=weight)
    return bins


def _joint(rp: Replicas, bins: np.ndarray, w: tuple[np.ndarray, np.ndarray]) -> Candidate:
    """Joint sets (E == L) balanced on ``w`` (columns, weights), repaired under the caps
    where exchanges can (:func:`.llm_sets.repair_joint`), failed where they still break one."""
    bins = repair_joint(rp, bins, *w)
    return Candidate(bins, bins, ~fits_cap(rp, bins))


def _pick(
    cands: list[Candidate], rp: Replicas, stage: StageCosts
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per replica one candidate ([R, n] E and L microbatch, and [R] whether it is shaped);
    replicas where none is usable (all break a cap or the budget, or leave an LLM set
    empty) get joint FFD sets.

    Balance first: a candidate must keep the encoder sets within ``_ENC_SLACK`` of the
    LPT sets and score within ``_TIME_PICK_SLACK`` of the best-balanced candidate. Among
    those the shortest proxy 1F1B iteration wins: equal scores can hide where the heavy
    microbatches sit, and that is what the pipeline pays for. Relative bands alone fail
    where every candidate is nearly perfect (scores 0.001 against 0.002): a candidate
    balanced in absolute terms (score within ``_GOOD_SCORE``, encoder CV within
    ``_GOOD_ENC_CV``) wins where its proxy iteration is more than ``_TIME_GAIN`` shorter."""
    r_count, m, valid, has_enc = rp.llm.shape[0], rp.m, rp.valid, rp.has_enc
    enc_ref = None
    scored = []
    shaped = []
    cvs = []  # [R, K] per candidate: its modules' CVs, which the straggler rule reads
    for c in cands:
        e_eff = np.where(has_enc, c.eidx, c.lidx)
        failed = c.failed | ~fits_patches(rp, e_eff)
        loads = module_loads(rp, e_eff, c.lidx)
        cvs.append(module_cv(loads))
        sc, ecv = _score(loads, c.profile, cvs[-1])
        if enc_ref is None:  # the first candidate's encoder sets are LPT-tight: the reference
            enc_ref = np.where(failed, np.inf, ecv)
        failed |= empty_llm_set(c.lidx, valid, m)
        scored.append((e_eff, c.lidx, np.where(failed, np.inf, sc), ecv))
        shaped.append(c.profile is not None)
    # the bands are relative to the best even candidate: a shaped one's score is measured
    # against its own profile and can be far lower than any even one's (co-shaped sets on
    # common-voice-ps left every candidate out of band, and the replica fell to FFD sets)
    every = np.min([sc for *_, sc, _ in scored], axis=0)
    even = [sc for (*_, sc, _), sh in zip(scored, shaped, strict=True) if not sh]
    best_sc = np.min(even, axis=0) if even else every
    best_sc = np.where(np.isfinite(best_sc), best_sc, every)

    def in_band(sc, ecv, score_level: float, enc_level: float) -> np.ndarray:
        """[R] within the relative bands of the best candidate, or under the absolute levels."""
        ok = sc <= np.maximum(best_sc * (1 + _TIME_PICK_SLACK), score_level) + 1e-12
        return ok & (ecv <= np.maximum(enc_ref * (1 + _ENC_SLACK) + 1e-3, enc_level))

    price = _price(rp, stage)
    keys = [
        np.where(
            np.isfinite(sc) & in_band(sc, ecv, _GOOD_SCORE, _GOOD_ENC_CV), price(e_eff, cl), np.inf
        )
        for e_eff, cl, sc, ecv in scored
    ]

    def fastest(score_level: float, enc_level: float, of_shaped: bool):
        """[R] shortest proxy time among the (shaped or even) candidates in the band, and
        which one."""
        key, pick = np.full(r_count, np.inf), np.full(r_count, -1)
        for i, (_, _, sc, ecv) in enumerate(scored):
            if shaped[i] != of_shaped:
                continue
            k = np.where(in_band(sc, ecv, score_level, enc_level), keys[i], np.inf)
            pick = np.where(k < key, i, pick)
            key = np.minimum(k, key)
        return key, pick

    best_key, pick = fastest(0.0, 0.0, False)
    wide_key, wide = fastest(_GOOD_SCORE, _GOOD_ENC_CV, False)
    take = wide_key < best_key * (1 - _TIME_GAIN)
    best_key = np.where(take, wide_key, best_key)
    pick = np.where(take, wide, pick)
    if any(shaped):
        sh_key, sh = fastest(_GOOD_SCORE, _GOOD_ENC_CV, True)
        take = sh_key < best_key * (1 - _SHAPE_GAIN)
        best_key = np.where(take, sh_key, best_key)
        pick = np.where(take, sh, pick)
    pick, best_key = _stragglers(rp, scored, cvs, keys, pick, best_key, price)
    eidx, lidx = _taken(scored, pick)
    for r in np.flatnonzero(~np.isfinite(best_key)):
        v = valid[r]
        joint = ffd_joint(
            rp.llm[r, v] + rp.enc_w[r, v] * 1e-9,
            rp.tok[r, v],
            m,
            rp.cap,
            f"replica {int(r)}",
            rp.patches[r, v],
            rp.patch_cap,
        )
        eidx[r, v] = joint
        lidx[r, v] = joint
    return eidx, lidx, np.isin(pick, np.flatnonzero(shaped)) & np.isfinite(best_key)


def _price(rp: Replicas, stage: StageCosts):
    """The pick's price of sets (eidx, lidx) -> [R]: the proxy 1F1B time on the plan's depth
    (``stage``: its stage costs), or where the caller gave none the mean over
    :data:`.pipeline_search.UNKNOWN_DEPTHS` relative to each depth's even pipeline. Only
    the pick hedges: the search still runs on the default depth."""
    if rp.depth_known:
        return lambda eidx, lidx: proxy_times(rp, eidx, lidx, stage)
    return depth_blind_pricer(rp)


def _stragglers(rp: Replicas, scored, cvs, keys, pick, best_key, price):
    """[R] pick and price, revised where the slowest replicas can be faster (``price``: the
    pick's, :func:`_price`; ``cvs``: each candidate's modules' CVs [R, K]).

    The iteration lasts as long as its slowest replica, so balance first is right for
    every replica but those that set the time. The floor is the slowest replica's best
    reach: the largest over replicas of the shortest proxy time among its own pick and
    the candidates whose every module keeps its per-microbatch CV within ``_STRAGGLER_CV``
    of a random equal-count cut's, or, where the plan's depth is known, at the lowest CV any
    usable candidate has on that module where that is higher (a module none can even out
    does not rule them all out: clips of one or two 30 s windows, 4 to a microbatch; on the
    pick's hedged price over 2, 4 and 8 stages it took sets that ran 1.1% slower on 8 stages
    untold, `librispeech` at 8192 / dp 128). A replica whose pick is slower
    than the floor takes, of the candidates that reach it within that bound, the best
    balanced (lowest score); the others keep their pick. Where the slowest replica cannot
    be faster nothing changes.

    With more replicas than a pass of the pipeline search takes (its ``SEARCH_FOCUS``), the
    floor sits up to ``_SEARCH_GAIN`` lower, times the share of replicas a pass leaves out
    (none up to 32 replicas, 1.5% at 128), and never below a replica's own reach. The
    search then gives the slowest replicas the most moves, and deferring sets gain little
    from it: a replica a little faster than the floor kept them, the slowest was searched
    below it, and it set the iteration (untold at 8192 / dp 128, `mix:captions`/vla-3b: its
    picked sets priced 1.090 where shaped joint ones priced 1.073, and 0.997 of `verl_kk`
    in the balance bench; 1.001 with the margin). Where the depth is not told, a replica
    takes such a candidate only where no depth of the hedged price runs it slower than its
    pick (without that check, `mix:video`/vl-1b run on 8 stages went 1.004 -> 0.994 of the
    best keeping peer; with it, 1.004). Where every replica gets the whole search, nothing
    changes: there a margin cost balance and bought no time (512 / dp 4: the encoder CV
    6.3x below `sequential`'s became 5.0x).
    """
    bound = _STRAGGLER_CV * rp.cut_cv
    if rp.depth_known:  # priced on the plan's depth; a hedged price keeps the bound as is
        usable = [
            np.where(np.isfinite(sc)[:, None], cv, np.inf) for cv, (*_, sc, _) in zip(cvs, scored)
        ]
        least = np.min(usable, axis=0)  # [R, K]: what the most even usable candidate reaches
        bound = np.maximum(bound, np.where(np.isfinite(least), least, 0.0))
    times = np.full((len(scored), len(pick)), np.inf)
    for i, (e_eff, cl, sc, _) in enumerate(scored):
        ok = np.isfinite(sc)
        if ok.any():
            ok &= (cvs[i] <= bound + 1e-12).all(axis=1)
        if not ok.any():
            continue
        t = keys[i]
        if not np.isfinite(t[ok]).all():  # outside the balance band: not priced yet
            t = np.where(np.isfinite(t), t, price(e_eff, cl))
        times[i] = np.where(ok, t, np.inf)
    reach = np.minimum(times.min(axis=0), best_key)
    if not np.isfinite(reach).any():
        return pick, best_key
    top = float(reach[np.isfinite(reach)].max())
    left_out = max(0.0, 1.0 - SEARCH_FOCUS / len(pick))
    floor = top * (1 - _SEARCH_GAIN * left_out)
    floor = np.where(np.isfinite(reach), np.maximum(floor, reach), floor)  # [R], each's own
    score = np.array([sc for _, _, sc, _ in scored])
    by_score = np.where(times <= floor * (1 + 1e-9), score, np.inf)
    alt = by_score.argmin(axis=0)
    slow = np.isfinite(best_key) & (best_key > floor * (1 + 1e-6))
    sw = slow & np.isfinite(by_score.min(axis=0))
    near = sw & (best_key <= top * (1 + 1e-6))  # taken for the margin alone
    if near.any() and not rp.depth_known:  # hedged: no depth may run it slower
        sw &= ~near | _no_depth_slower(scored, alt, pick, price)
    return np.where(sw, alt, pick), np.where(sw, times[alt, np.arange(len(pick))], best_key)


def _no_depth_slower(scored, alt, pick, price) -> np.ndarray:
    """[R] whether candidate ``alt`` runs no slower than ``pick`` on every depth the hedged
    ``price`` (:func:`.pipeline_search.depth_blind_pricer`) averages."""
    d_alt = price(*_taken(scored, alt), per_depth=True)
    d_pick = price(*_taken(scored, pick), per_depth=True)
    return (d_alt <= d_pick * (1 + 1e-9)).all(axis=0)


def _taken(scored, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([R, n] E, [R, n] L microbatch) of candidate ``which[r]`` of ``scored`` on every
    replica r (0 where ``which`` names none)."""
    eidx = np.zeros_like(scored[0][0])
    lidx = np.zeros_like(eidx)
    for i, (e_eff, cl, _, _) in enumerate(scored):
        sel = which == i
        eidx = np.where(sel[:, None], e_eff, eidx)
        lidx = np.where(sel[:, None], cl, lidx)
    return eidx, lidx


def _edges_light(eidx, lidx, valid, work, m, keep=None):
    """Reorder the microbatches of replicas without deferral so the heaviest (by ``work``
    [R, n], a sample's work on the pipeline's stages) sit in the middle (replicas in
    ``keep`` [R], shaped ones, are already in the order their shape wants).

    1F1B pays the first microbatch's forward and the last one's backward across every
    stage (fill and drain) on top of the steady state; heavy microbatches there lengthen
    the iteration, in the middle they are absorbed. Replicas that defer keep their order:
    a permutation could put a sample's LLM set before its encoder set.
    """
    joint = ((eidx == lidx) | ~valid).all(axis=1)
    if keep is not None:
        joint &= ~keep
    if not joint.any() or m < 3:
        return eidx, lidx
    load = slot_sums(lidx, work, valid & (lidx >= 0), m)
    remap = np.where(joint[:, None], mountain_positions(load), np.arange(m)[None, :])
    return relabel_slots(remap, eidx, valid), relabel_slots(remap, lidx, valid)


def _grouped(members: np.ndarray, slot: np.ndarray, count: int) -> list[np.ndarray]:
    """Members (sample indices, >= 0) grouped by slot (0..count-1), ascending inside a group
    (one integer key sorts in half the time of ``lexsort``'s two, and the bounds come from
    the slot counts)."""
    key = slot.astype(np.int64) * (int(members.max(initial=0)) + 1) + members
    ms = members[np.argsort(key)]
    bounds = [0, *np.bincount(slot, minlength=count).cumsum().tolist()]
    return [ms[bounds[k] : bounds[k + 1]] for k in range(count)]


def _to_assignment(method, members, valid, eidx, lidx, r_count, m) -> Assignment:
    """Collect per-(replica, microbatch) index arrays (ascending sample order inside a set)."""
    rep = np.broadcast_to(np.arange(r_count)[:, None], members.shape)[valid]
    mem = members[valid]
    enc = _grouped(mem, rep * m + eidx[valid], r_count * m)
    llm = _grouped(mem, rep * m + lidx[valid], r_count * m)
    enc_sets = [enc[r * m : (r + 1) * m] for r in range(r_count)]
    llm_sets = [llm[r * m : (r + 1) * m] for r in range(r_count)]
    return Assignment(method, r_count, m, enc_sets, llm_sets)
