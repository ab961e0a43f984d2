"""Refinement of the level-2 sets against a simulated 1F1B pipeline (a proxy of the plan's).

Balanced microbatch sums are the means, not the goal: what training pays is the
1F1B iteration time. With whole samples some microbatches must stay heavy (a
600-dpi scan can carry three mean microbatches of encoder work), and where
they sit decides whether the pipeline absorbs them. On an encoder stage the
forward comes from E_j but the backward from L_j (split backward), so one heavy
sample loads its encoder stages twice, at its encoder and at its LLM
microbatch; 1F1B lets a stage run only a few microbatches ahead of the next, so
the LLM stage stalls unless its own work around those points is heavy enough
to cover them. Sums cannot express that; a simulation can.

``assign`` sees per-module costs and, where the caller has the plan, its stage layout as
each module's share of work on every stage (``stage_shares``, the plan's; the loader
service passes it): the simulation then runs on the plan's stages. Without it ``assign``
knows at most the plan's depth (``pipeline_stages``, the plan's pp; 4 where not given, the
pick then hedging over several: :func:`depth_blind_pricer`), and the simulation runs on a
proxy pipeline built from the costs the way the static planner builds layouts: that many
stages, the encoders in front (their chain of columns cut into equal contiguous shares, or
all on the first stage with the head of the LLM), the LLM behind, the split between them the
one whose busiest stage is lightest (:func:`proxy_stage_shares`). Laid out from sample
totals, those shares miss the plan's by what the planner's layer granularity and the
embedding, head and windowed layers move; told the plan's, entrain's mean lead over the best
peer grew by 0.2-0.4% at every setting of ``bench/balance.py`` (bench/RESULTS.md). Either
way a module's cost is one third forward, two thirds backward (a trainable module).

The search itself is a seeded local search over whole-sample moves, all
replicas at once: each round draws ``_CANDIDATES`` moves per replica (a
sample's LLM microbatch later or earlier, its encoder microbatch earlier or
later, or two samples exchanging their (E, L) slots), drops the ones that break
``L >= E``, the token cap, the deferral budget or a module's CV limit
(:func:`cv_limits`), simulates the rest in one
vectorised pass and keeps the best if it shortens the replica's proxy
iteration. The proxy time of a replica therefore never grows, and no move may
leave an LLM set empty. A replica holding a sample heavier than a mean microbatch
(:func:`outliers`) is searched with more room where the plan's depth is told: such a
microbatch is heavy whatever the cut, and 1F1B runs it fastest with light work beside
it and little at the edges, which the limits of a balanced replica forbid.

An encoder that ``assign`` is told is frozen (``frozen_encoders``) has no backward:
its whole cost runs with its encoder set, and deferring its samples costs the
encoder stages nothing in the L sets.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import compiled
from ..simulator import simulate_pipeline, topological_order
from .common import DEFAULT_PIPELINE_STAGES, Replicas, module_cv, random_cut_cv, slot_sums

__all__ = [
    "SEARCH_FOCUS",
    "UNKNOWN_DEPTHS",
    "cv_limits",
    "depth_blind_pricer",
    "proxy_stage_shares",
    "proxy_times",
    "refine_by_pipeline",
    "refine_slowest",
    "stage_costs",
    "stage_rows",
]

_FWD_SHARE = 1.0 / 3.0  # forward share of a trainable module's forward + backward cost
_CANDIDATES = 32  # moves tried per replica and round
_ROUNDS = 64
SEARCH_FOCUS = 32  # replicas searched per pass when there are more (the slowest ones)
_PASS_ROUNDS = 16  # rounds per pass over the slowest replicas
_LAST_FOCUS = 4  # after the passes, the slowest replicas get one more, with more candidates
_LAST_ROUNDS = 32
_PATIENCE = 8  # rounds without any accepted move after which the search stops
_CANDIDATE_BUDGET = 128  # replicas x candidates simulated per round, at most
_CV_SLACK = 0.04  # an encoder column's per-microbatch CV may grow by this share in the search
_LLM_CV_SLACK = 0.10  # the LLM's (the L sets')
_CV_FLOOR = 0.002  # ... plus this much
_RANDOM_SHARE = 0.05  # or up to this share of a random equal-count cut's CV (cv_limits)
# on a module where the replica holds a sample heavier than a mean microbatch, this share
# (the straggler rule's bound, entrain._STRAGGLER_CV): its sets are uneven whatever the cut
_OUTLIER_SHARE = 0.75


def proxy_stage_shares(
    module_totals: np.ndarray, stages: int = DEFAULT_PIPELINE_STAGES
) -> np.ndarray:
    """[S, K] share of module k's work held by stage s; the last column is the LLM.

    The encoders (columns 0..K-2, in order) fill the first stages as one chain
    cut into equal contiguous pieces, the LLM the rest in equal pieces; the
    number of encoder stages is the one whose busiest stage is lightest. Where the
    encoders are lighter than a stage's share, they ride on the first stage with the
    head of the LLM and every stage carries the same (the planner's layout with no pure
    encoder stage: at 2 stages most rows of the bench's vla-3b model run that way). No
    encoder work: every stage holds an equal share of the LLM.
    """
    tot = np.asarray(module_totals, dtype=np.float64)
    k = len(tot)
    enc_total, llm_total = float(tot[:-1].sum()), float(tot[-1])
    shares = np.zeros((stages, k))
    if enc_total <= 0 or stages < 2:
        shares[:, -1] = 1.0 / stages
        if stages == 1:
            shares[0, :-1] = 1.0
        return shares
    if llm_total <= 0:
        s_enc = stages
    else:
        s_enc = min(range(1, stages), key=lambda s: max(enc_total / s, llm_total / (stages - s)))
        head = (enc_total + llm_total) / stages - enc_total  # LLM work beside the encoders
        if head > 1e-9 * llm_total and enc_total + head < max(
            enc_total / s_enc, llm_total / (stages - s_enc)
        ):  # the encoders ride on the first stage with the head of the LLM: every stage equal
            shares[0, :-1] = np.where(tot[:-1] > 0, 1.0, 0.0)
            shares[0, -1] = head / llm_total
            shares[1:, -1] = (1.0 - head / llm_total) / (stages - 1)
            return shares
    cum = np.concatenate([[0.0], np.cumsum(tot[:-1])])  # module boundaries on the chain
    for s in range(s_enc):
        lo, hi = enc_total * s / s_enc, enc_total * (s + 1) / s_enc
        overlap = np.clip(np.minimum(cum[1:], hi) - np.maximum(cum[:-1], lo), 0.0, None)
        shares[s, :-1] = np.where(tot[:-1] > 0, overlap / np.where(tot[:-1] > 0, tot[:-1], 1), 0)
    if s_enc < stages:
        shares[s_enc:, -1] = 1.0 / (stages - s_enc)
    return shares


def cv_limits(
    cv0: np.ndarray,
    cost: np.ndarray,
    valid: np.ndarray,
    m: int,
    outlier: np.ndarray | None = None,
    cut: np.ndarray | None = None,
) -> np.ndarray:
    """[R, K] the per-microbatch CV each module may reach in the search: its start's CV plus
    a share (``_CV_SLACK``, ``_LLM_CV_SLACK`` for the LLM, the last column) and
    ``_CV_FLOOR``, or ``_RANDOM_SHARE`` of the CV a random equal-count cut of the replica's
    samples gives (``cost`` [R, n, K]), whichever is larger.

    Near-perfect sets (CVs of 0.002 with 16 samples a microbatch) otherwise leave the search
    no room to shorten the pipeline, which on 1F1B pays for uneven microbatches in its
    fill and drain: at 4096 / dp 16 the peers' uneven sets ran 0.5% faster than entrain's
    even ones. Measured against what fixed-count microbatches get in expectation, the
    allowance keeps every module's CV at least 1 / ``_RANDOM_SHARE`` times below theirs,
    and it is zero where every sample costs the same (nothing to gain by unbalancing).

    Where ``outlier`` ([R, K], :func:`outliers`) marks a module on which the replica holds
    a sample heavier than a mean microbatch, the share there is ``_OUTLIER_SHARE``: that
    microbatch is heavy on the module whatever the cut, and 1F1B runs it fastest with the
    light work in the microbatches beside it, little at the edges, rather than the rest
    spread evenly (:func:`refine_by_pipeline`). ``cut``: :func:`.common.random_cut_cv` of
    ``cost``, where the caller has it (:attr:`.common.Replicas.cut_cv`).
    """
    slack = np.full(cv0.shape[-1], _CV_SLACK)
    slack[-1] = _LLM_CV_SLACK
    share = np.full(cv0.shape, _RANDOM_SHARE)
    if outlier is not None:
        share[outlier] = _OUTLIER_SHARE
    cut = random_cut_cv(cost, valid, m) if cut is None else cut
    return np.maximum(cv0 * (1 + slack) + _CV_FLOOR, share * cut)


def outliers(cost: np.ndarray, m: int) -> np.ndarray:
    """[R, K] whether a replica holds a sample heavier on module k than its mean microbatch
    of that module (``cost`` [R, n, K], pads zero): that sample's microbatch is heavy there
    whatever the cut."""
    mean_mb = cost.sum(axis=1) / m
    return cost.max(axis=1) > np.where(mean_mb > 0, mean_mb, np.inf)


def _module_totals(enc_cols: np.ndarray, llm: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[K] every module's work over all replicas (the encoder columns, the LLM last): what
    :func:`proxy_stage_shares` lays out on the stages."""
    return np.concatenate(
        [np.where(valid[..., None], enc_cols, 0.0).sum(axis=(0, 1)), [llm[valid].sum()]]
    )


def _forward_shares(frozen: np.ndarray | None, e_count: int) -> np.ndarray:
    """[E] forward share of each encoder's cost: a frozen one runs forward only."""
    if frozen is None:
        return np.full(e_count, _FWD_SHARE)
    return np.where(frozen, 1.0, _FWD_SHARE)


def _per_stage(
    enc_cols, llm, valid, frozen=None, stages=DEFAULT_PIPELINE_STAGES, layout=None, shares=None
):
    """Per-sample proxy stage costs [R, n, S] on ``stages`` stages: encoder forward (with
    E), forward and backward that run with L (LLM forward; encoder and LLM backward). A
    frozen encoder (``frozen`` [E] bool) is all forward: its whole cost runs with E. The
    stages are the plan's ``shares`` ([S, K]) where told, else laid out on ``layout``
    (module totals [K]) where given, else on these samples'."""
    if shares is not None:
        sh = shares
    else:
        totals = _module_totals(enc_cols, llm, valid) if layout is None else layout
        sh = proxy_stage_shares(totals, stages)  # [S, K]
    trainable = frozen is None or not np.any(frozen)
    if trainable:
        e_f = e_b = enc_cols @ sh[:, :-1].T  # [R, n, S]
    else:
        fwd = _forward_shares(frozen, enc_cols.shape[-1])
        e_f, e_b = (enc_cols * fwd) @ sh[:, :-1].T, (enc_cols * (1 - fwd)) @ sh[:, :-1].T
    if compiled.enabled() and enc_cols.size:  # the masks and scalings below in one pass
        from .search_kernel import stage_parts  # numba is imported with it

        sh_l = np.ascontiguousarray(sh[:, -1], dtype=np.float64)
        c = np.ascontiguousarray
        return stage_parts(c(e_f), c(e_b), c(llm, dtype=np.float64), sh_l, c(valid),
                           _FWD_SHARE, 1 - _FWD_SHARE, trainable)  # fmt: skip
    l_stage = llm[..., None] * sh[None, None, :, -1]
    zero = ~valid[..., None]
    lf = np.where(zero, 0.0, _FWD_SHARE * l_stage)
    if trainable:
        ef = np.where(zero, 0.0, _FWD_SHARE * e_f)
        lb = np.where(zero, 0.0, (1 - _FWD_SHARE) * (e_f + l_stage))
        return ef, lf, lb
    ef = np.where(zero, 0.0, e_f)
    lb = np.where(zero, 0.0, e_b + (1 - _FWD_SHARE) * l_stage)
    return ef, lf, lb


def stage_costs(rp: Replicas):
    """(ef, lf, lb) [R, n, S] of ``rp``'s members on its proxy pipeline (:func:`_per_stage`)."""
    return _per_stage(rp.enc_cols, rp.llm, rp.valid, rp.frozen, rp.stages, rp.layout, rp.shares)


def _loads(idx, per_sample, valid, m):
    """[R, M, S] sums of per-sample [R, n, S] over the members of each microbatch."""
    return slot_sums(idx, per_sample, valid, m)


def _span(first, end, jj):
    """[..., M] mask of the boundaries first <= j < end (a sample waits across them)."""
    return (jj >= first[..., None]) & (jj < end[..., None])


def _waiting(eidx, lidx, wait_tok, m):
    """[R, M] tokens buffered after each boundary j: the samples' ``wait_tok`` [R, n] over
    e <= j < l, the running sum of what enters at e less what leaves at l (whole numbers:
    the same as summing the spans, without an [R, n, M] mask). The search's invariants hold:
    e <= l, and a sample without a slot (-1) has no tokens to wait with."""
    w = wait_tok.astype(np.float64)
    every = np.ones(eidx.shape, bool)  # slots -1 count nowhere (slot_sums)
    moved = slot_sums(eidx, w, every, m) - slot_sums(lidx, w, every, m)
    return np.rint(np.cumsum(moved, axis=1)).astype(np.int64)


def _replica_times(fwd, bwd):
    """[...] 1F1B times of [..., M, S] loads, clipped at 0 first: incremental updates leave
    rounding residue around zero."""
    shape = fwd.shape[:-2]
    m, s = fwd.shape[-2:]
    f = np.maximum(fwd.reshape(-1, m, s), 0.0)
    b = np.maximum(bwd.reshape(-1, m, s), 0.0)
    return _pipeline_times(f, b, _topo(m, s)).reshape(shape)


def proxy_times(rp: Replicas, eidx: np.ndarray, lidx: np.ndarray, stage=None) -> np.ndarray:
    """[R] proxy 1F1B iteration time of every replica for the sets (eidx, lidx).

    ``stage``: the (ef, lf, lb) of :func:`stage_costs`, when the caller already has them."""
    valid, m = rp.valid, rp.m
    ef, lf, lb = stage if stage is not None else stage_costs(rp)
    fwd, bwd = _proxy_loads(eidx, lidx, ef, lf, lb, valid, m)
    return _replica_times(fwd, bwd)


UNKNOWN_DEPTHS = (2, 4, 8)  # the depths a pick is priced on when the caller gives no pp


def depth_blind_pricer(rp: Replicas, depths: tuple[int, ...] = UNKNOWN_DEPTHS):
    """``price(eidx, lidx, per_depth=False, in_work=False) -> [R]``: the mean over ``depths``
    of the proxy 1F1B time relative to that depth's even pipeline (every microbatch the
    same, every stage the same), the price of a candidate when the plan's depth is not
    known; ``per_depth``: each depth's [D, R]; ``in_work``: relative to the even pipeline's
    fill and drain alone (the time over ``(m + d - 1) / (m d)``: in the costs' units, so
    batches of other work compare, as ``max_delay`` compares an iteration with its landing).
    The per-sample columns, the stage shares and the schedules are computed once for every
    candidate of one ``rp``.

    The fill and drain fall elsewhere at every depth, so sets priced on one depth can lose
    on another: priced on 4 stages and run on 8, entrain trailed the best peer on 8 of 34
    rows at 512 / dp 4 / 32 (0.979 at worst). One slot sum per module serves every depth:
    a stage's load is the modules' per-microbatch loads times their shares on it. The
    stages are laid out on ``rp.layout`` where given (``max_delay``), else on ``rp``'s
    module totals."""
    valid, m = rp.valid, rp.m
    fwd_share = _forward_shares(rp.frozen, rp.enc_cols.shape[2])
    enc = np.where(valid[..., None], rp.enc_cols, 0.0)
    llm = np.where(valid, rp.llm, 0.0)[..., None]
    with_e = enc * fwd_share  # [R, n, E] runs with the E set (the encoders' forward)
    with_l = np.concatenate([enc * (1 - fwd_share), llm], axis=2)  # their backward, the LLM
    totals = _module_totals(rp.enc_cols, rp.llm, valid)
    work = totals.sum() / len(valid)  # a replica's mean work, every module
    laid = totals if rp.layout is None else rp.layout
    plans = [
        (
            proxy_stage_shares(laid, d),  # [S, K]
            (work * (m + d - 1) / (m * d) if work > 0 else 1.0, (m + d - 1) / (m * d)),
            _topo(m, d),
        )
        for d in depths
    ]

    def price(eidx, lidx, per_depth: bool = False, in_work: bool = False) -> np.ndarray:
        e_fwd = _loads(eidx, with_e, valid, m)  # [R, M, E]
        l_all = _loads(lidx, with_l, valid, m)  # [R, M, E + 1]
        each = []
        for sh, (even, unit), topo in plans:
            mm_f, mm_b = e_fwd @ sh[:, :-1].T, l_all[..., :-1] @ sh[:, :-1].T  # [R, M, S]
            if compiled.enabled():  # the same loads, built in the recurrence's lanes
                from .search_kernel import shared_recurrence  # numba is imported with it

                l_last = np.ascontiguousarray(l_all[..., -1])
                t = shared_recurrence(mm_f, mm_b, l_last, sh[:, -1].copy(), _FWD_SHARE,
                                      1 - _FWD_SHARE, topo)  # fmt: skip
            else:
                l_stage = l_all[..., -1:] * sh[:, -1]  # [R, M, S]
                fwd = mm_f + _FWD_SHARE * l_stage
                bwd = mm_b + (1 - _FWD_SHARE) * l_stage
                t = _pipeline_times(fwd, bwd, topo)
            each.append(t / (unit if in_work else even))
        each = np.array(each)  # [D, R]; summed in depth order, as before
        return each if per_depth else each.sum(axis=0) / len(plans)

    return price


@lru_cache(maxsize=64)
def _topo(m: int, stages: int) -> np.ndarray:
    """The 1F1B ops of ``m`` microbatches on ``stages`` stages in dependency order, as the
    compiled recurrence reads them ([2 m S, 3] stage, kind, microbatch; cached: shared by
    every caller, not to be written)."""
    return np.asarray(topological_order("1f1b", m, stages), dtype=np.int64)


def _pipeline_times(fwd: np.ndarray, bwd: np.ndarray, topo: np.ndarray) -> np.ndarray:
    """[R] 1F1B times of [R, M, S] loads (>= 0): the simulator's recurrence, called
    directly where it is compiled (the checks and the summary cost more than it)."""
    if compiled.enabled():
        from .search_kernel import recurrence  # numba is imported with it

        return recurrence(np.ascontiguousarray(fwd), np.ascontiguousarray(bwd), topo)
    return simulate_pipeline(fwd, bwd).replica_times


def _proxy_loads(eidx, lidx, ef, lf, lb, valid, m):
    """[R, M, S] forward and backward proxy loads; the two L-set sums in one pass (each sum
    adds the same members in the same order as two passes would); compiled, the three."""
    if compiled.enabled() and eidx.size:
        from .search_kernel import proxy_loads  # numba is imported with it

        c = np.ascontiguousarray
        return proxy_loads(eidx, lidx, c(ef), c(lf), c(lb), valid, m)
    s = lf.shape[-1]
    both = _loads(lidx, np.concatenate([lf, lb], axis=-1), valid, m)
    return _loads(eidx, ef, valid, m) + both[..., :s], both[..., s:]


def _apply(eidx, lidx, g, bk, a, b, moved_b, na_e, na_l, nb_e, nb_l) -> None:
    """Commit candidate ``bk[i]`` of replica ``g[i]`` to the slot arrays."""
    ai, bi = a[g, bk], b[g, bk]
    mb = moved_b[g, bk]
    eidx[g, ai], lidx[g, ai] = na_e[g, bk], na_l[g, bk]
    eidx[g[mb], bi[mb]], lidx[g[mb], bi[mb]] = nb_e[g, bk][mb], nb_l[g, bk][mb]


def refine_slowest(
    rp: Replicas,
    eidx: np.ndarray,
    lidx: np.ndarray,
    rng: np.random.Generator,
    stage: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The search where it pays: the iteration lasts as long as its slowest replica, so
    with many replicas every pass searches only the ``SEARCH_FOCUS`` slowest (by proxy time,
    re-ranked after each pass) with more candidates each. The work is then bounded by
    ``SEARCH_FOCUS`` x candidates x ``_ROUNDS`` at any dp: one algorithm for every size.

    A last pass gives the ``_LAST_FOCUS`` slowest replicas ``_LAST_ROUNDS`` rounds with the
    whole candidate budget between them (32 moves each a round, against 4 among 32 replicas):
    where one replica holds the iteration's outliers, its search otherwise ends
    under-explored (text-heavy/vl-1b-1280 at 8192 / dp 128: 1.1% of iteration time).
    ``stage``: :func:`stage_costs` of ``rp`` where the caller has them."""
    r_count = rp.llm.shape[0]
    stage = stage_costs(rp) if stage is None else stage
    if r_count <= _LAST_FOCUS:
        return refine_by_pipeline(rp, eidx, lidx, rng, stage=stage)
    if r_count <= SEARCH_FOCUS:
        eidx, lidx = refine_by_pipeline(rp, eidx, lidx, rng, stage=stage)
        cur = proxy_times(rp, eidx, lidx, stage)
    else:
        eidx, lidx, cur = _focused_passes(rp, eidx, lidx, rng, stage)
    eidx, lidx = eidx.copy(), lidx.copy()
    act = np.sort(np.argsort(-cur, kind="stable")[:_LAST_FOCUS])
    e_a, l_a = refine_by_pipeline(
        rp.take(act), eidx[act], lidx[act], rng, _LAST_ROUNDS, stage=stage_rows(stage, act)
    )
    eidx[act], lidx[act] = e_a, l_a
    return eidx, lidx


def _focused_passes(rp, eidx, lidx, rng, stage):
    """Passes over the ``SEARCH_FOCUS`` slowest replicas, re-ranked after each; the sets and
    every replica's proxy time after them (a pass re-prices only the replicas it searched)."""
    eidx, lidx = eidx.copy(), lidx.copy()
    cur = proxy_times(rp, eidx, lidx, stage)
    for _ in range(_ROUNDS // _PASS_ROUNDS):
        act = np.sort(np.argsort(-cur, kind="stable")[:SEARCH_FOCUS])
        sub, st = rp.take(act), stage_rows(stage, act)
        e_a, l_a = refine_by_pipeline(sub, eidx[act], lidx[act], rng, _PASS_ROUNDS, stage=st)
        eidx[act], lidx[act] = e_a, l_a
        cur[act] = proxy_times(sub, e_a, l_a, st)
    return eidx, lidx, cur


def stage_rows(stage, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """``stage``'s (ef, lf, lb) of some replicas (an index or a mask): a subset is searched
    and priced on the batch's stage layout, the one its replicas are ranked on (laid out on
    the subset's own module totals, the four slowest replicas were searched on a slightly
    other pipeline)."""
    return tuple(s[rows] for s in stage)


def refine_by_pipeline(
    rp: Replicas,
    eidx: np.ndarray,
    lidx: np.ndarray,
    rng: np.random.Generator,
    rounds: int | None = None,
    candidates: int = _CANDIDATES,
    stage: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Improved ([R, n] E microbatch, [R, n] L microbatch) under every invariant.

    The objective is the proxy pipeline's iteration time per replica, under the
    limit on every module's per-microbatch CV. Inputs must already
    satisfy the invariants (L >= E, E == L for samples without encoder work, the
    token cap, the patch cap and the budget); so do the outputs. ``stage``: the (ef, lf,
    lb) of :func:`stage_costs` for ``rp``'s replicas, where the caller has them.
    """
    valid, has_enc, llm, tok = rp.valid, rp.has_enc, rp.llm, rp.tok
    m, cap, budget = rp.m, rp.cap, rp.budget
    r_count, n = llm.shape
    rounds = _ROUNDS if rounds is None else rounds
    if m < 2 or n == 0 or rounds <= 0:
        return eidx, lidx
    eidx, lidx = eidx.copy(), lidx.copy()
    ef, lf, lb = stage_costs(rp) if stage is None else stage
    fwd, bwd = _proxy_loads(eidx, lidx, ef, lf, lb, valid, m)
    cur = _replica_times(fwd, bwd)  # [R]
    big = np.iinfo(np.int64).max // 4
    cap_v = big if cap is None else cap
    bud_v = big if budget is None else budget
    rows = np.arange(r_count)
    t_load = np.rint(slot_sums(lidx, tok.astype(np.float64), valid, m)).astype(np.int64)
    l_count = np.rint(slot_sums(lidx, np.ones((r_count, n)), valid, m)).astype(np.int64)
    pcap = rp.patch_cap
    p_samp = np.where((valid & has_enc)[..., None], rp.patches, 0)  # [R, n, E]
    p_load = np.rint(slot_sums(eidx, p_samp.astype(np.float64), valid, m)).astype(np.int64)
    wait_tok = np.where(valid & has_enc, tok, 0)
    # tokens buffered after boundary j: encoded at or before j, consumed after it
    waiting = _waiting(eidx, lidx, wait_tok, m)
    n_valid = valid.sum(axis=1)
    # the cost of a round grows with replicas x candidates: cap their product
    k_count = max(2, min(candidates, _CANDIDATE_BUDGET // r_count))
    order = np.argsort(~valid, axis=1, kind="stable")  # valid members first
    # per-microbatch module loads (each encoder column and, with several, their sum from E;
    # the LLM from L: Replicas.module_costs) and the sum of squares each may reach (see
    # cv_limits)
    mod_e = np.where(valid[..., None], rp.module_costs[..., :-1], 0.0)
    llm_v = np.where(valid, llm, 0.0)[..., None]
    mod = np.concatenate([_loads(eidx, mod_e, valid, m), _loads(lidx, llm_v, valid, m)], axis=2)
    mean = mod.mean(axis=1)  # [R, K]
    cv0 = module_cv(mod)
    cost = np.concatenate([mod_e, llm_v], axis=2)  # [R, n, K]
    # the room fits the light work to the proxy's depth: only where that is the plan's (the
    # search runs on 4 stages where none is given; run on 8, the 4-stage shape lost up to 3.5%)
    outlier = outliers(cost, m) & rp.depth_known  # [R, K]
    cv_lim = cv_limits(cv0, cost, valid, m, outlier, rp.cut_cv)
    ss_lim = m * mean**2 * (1 + cv_lim**2) * (1 + 1e-12)
    step = _round_numpy
    if compiled.enabled():
        from .search_kernel import search_round as step  # numba is imported with it
    topo = _topo(m, fwd.shape[2])
    # per replica: the token cap [R] and the patch cap [R, E]
    p_cap = np.zeros(p_samp.shape[2], np.int64) if pcap is None else np.asarray(pcap, np.int64)
    p_cap = np.broadcast_to(p_cap, (r_count, p_samp.shape[2])).copy()
    cap_r = np.full(r_count, cap_v, np.int64)
    # a time refinement: it never raises the largest encoder set level 2 built (the
    # activation-memory peak; the cap bounds level 2 itself), nor the largest LLM set where
    # memory is capped, but on a replica holding an outlier it may fill sets up to the caps
    even = ~outlier.any(axis=1)
    if pcap is not None and p_load.size:
        p_cap[even] = np.minimum(p_cap[even], p_load.max(axis=(0, 1)))
    if cap is not None and t_load.size:
        cap_r[even] = min(cap_v, int(t_load.max()))
    state = (fwd, bwd, mod, t_load, l_count, p_load, waiting, cur)
    per_sample = (eidx, lidx, has_enc, tok.astype(np.int64), wait_tok, p_samp, ef, lf, lb)
    # every round's draws at once (one generator call: per round, four cost more than the
    # compiled round itself): two samples per candidate (the second only moves in a swap),
    # the move's kind (0: move L, 1: move E, 2: swap) and its position
    draws = rng.random((rounds, 4, r_count, k_count))
    picks = (draws[:, :2] * n_valid[:, None]).astype(np.int64)
    picks = order[rows[:, None], picks]  # [rounds, 2, R, K] the valid members first
    kinds = (draws[:, 2] * 3).astype(np.int64)
    idle = 0
    for i in range(rounds):
        if idle >= _PATIENCE:  # no replica found a better move for this many rounds
            break
        idle += 1
        a, b, kind, u = picks[i, 0], picks[i, 1], kinds[i], draws[i, 3]
        moved = step(
            a, b, kind, u, *per_sample, mod_e, llm, *state,
            ss_lim, cap_r, bud_v, p_cap, pcap is not None, budget is not None, topo,
        )  # fmt: skip
        if moved:
            idle = 0
    return eidx, lidx


def _round_numpy(
    a, b, kind, u,  # [R, K] drawn by the caller: samples, move kinds, positions
    eidx, lidx, has_enc, tok, wait_tok, p_samp, ef, lf, lb, mod_e, llm,  # per sample
    fwd, bwd, mod, t_load, l_count, p_load, waiting, cur,  # per replica state, updated
    ss_lim, cap_v, bud_v, pcap, use_pcap, use_budget, topo,
) -> bool:  # fmt: skip
    """One search round over every replica and candidate at once (numpy); the state is
    updated in place where a replica's best move shortens its proxy time. The compiled
    :func:`.search_kernel.search_round` computes exactly this. True if any replica moved."""
    r_count, k_count = a.shape
    m = fwd.shape[1]
    rows = np.arange(r_count)
    rk = np.broadcast_to(rows[:, None], (r_count, k_count))
    jj = np.arange(m)
    ea, la = eidx[rk, a], lidx[rk, a]
    eb_, lb_ = eidx[rk, b], lidx[rk, b]
    enc_a = has_enc[rk, a]
    # new slots of a
    new_l = np.where(enc_a, ea + (u * (m - ea)).astype(np.int64), (u * m).astype(np.int64))
    new_e_move = np.where(enc_a, (u * (la + 1)).astype(np.int64), new_l)
    na_e = np.select([kind == 0, kind == 1], [np.where(enc_a, ea, new_l), new_e_move], eb_)
    na_l = np.select([kind == 0, kind == 1], [new_l, np.where(enc_a, la, new_e_move)], lb_)
    swap = kind == 2
    nb_e = np.where(swap, ea, eb_)
    nb_l = np.where(swap, la, lb_)
    # samples without encoder work are never buffered: their E is their L
    na_e = np.where(enc_a, na_e, na_l)
    nb_e = np.where(has_enc[rk, b], nb_e, nb_l)
    moved_b = swap & (a != b)
    changed = (na_e != ea) | (na_l != la)
    # token cap on the L sets
    ta, tb = tok[rk, a], tok[rk, b]
    t_new = np.broadcast_to(t_load[:, None, :], (r_count, k_count, m)).copy()
    rk3 = rk.ravel()
    kk = np.broadcast_to(np.arange(k_count)[None, :], (r_count, k_count)).ravel()
    for idx_l, sign, w, on in (
        (la, -1, ta, changed),
        (na_l, 1, ta, changed),
        (lb_, -1, tb, moved_b),
        (nb_l, 1, tb, moved_b),
    ):
        t_new[rk3, kk, idx_l.ravel()] += (sign * w * on).ravel()  # one slot per (r, k)
    ok = changed & (t_new <= cap_v[:, None, None]).all(axis=2)
    # no L set may become empty: a microbatch without LLM work has nothing to train
    c_new = np.broadcast_to(l_count[:, None, :], (r_count, k_count, m)).copy()
    for idx_l, sign, on in (
        (la, -1, changed),
        (na_l, 1, changed),
        (lb_, -1, moved_b),
        (nb_l, 1, moved_b),
    ):
        c_new[rk3, kk, idx_l.ravel()] += (sign * on).ravel().astype(np.int64)
    ok &= (c_new >= np.minimum(l_count, 1)[:, None, :]).all(axis=2)
    # patch cap on the E sets
    if use_pcap:
        p_new = np.broadcast_to(p_load[:, None], (r_count, k_count) + p_load.shape[1:]).copy()
        for idx_e, s_idx, sign, on in (
            (ea, a, -1, ok),
            (na_e, a, 1, ok),
            (eb_, b, -1, ok & moved_b),
            (nb_e, b, 1, ok & moved_b),
        ):
            pv = p_samp[rk, s_idx] * (sign * on)[..., None]
            p_new[rk3, kk, idx_e.ravel()] += pv.reshape(-1, pv.shape[-1])
        ok &= (p_new <= pcap[:, None, None, :]).all(axis=(2, 3))
    # deferral budget on the buffer after every boundary
    if use_budget:
        wa, wb = wait_tok[rk, a], wait_tok[rk, b]
        w_new = (
            waiting[:, None, :]
            - (_span(ea, la, jj) * (wa * changed)[..., None])
            + (_span(na_e, na_l, jj) * (wa * changed)[..., None])
            - (_span(eb_, lb_, jj) * (wb * moved_b)[..., None])
            + (_span(nb_e, nb_l, jj) * (wb * moved_b)[..., None])
        )
        ok &= (w_new <= bud_v).all(axis=2)
    # the sets stay balanced: no module's per-microbatch CV may grow past its limit
    cm = np.broadcast_to(mod[:, None], (r_count, k_count, m, mod.shape[2])).copy()
    for s_idx, old_e, old_l, new_e, new_l2, on in (
        (a, ea, la, na_e, na_l, ok),
        (b, eb_, lb_, nb_e, nb_l, ok & moved_b),
    ):
        w = on[..., None].astype(np.float64)
        e_c = np.concatenate([mod_e[rk, s_idx], np.zeros((r_count, k_count, 1))], 2) * w
        l_c = np.concatenate([np.zeros_like(mod_e[rk, s_idx]), llm[rk, s_idx][..., None]], 2)
        l_c = l_c * w
        for idx_, val in ((old_e, -e_c), (new_e, e_c), (old_l, -l_c), (new_l2, l_c)):
            cm[rk3, kk, idx_.ravel()] += val.reshape(-1, val.shape[-1])
    ss = (cm * cm).sum(axis=2)  # [R, K, modules]
    ok &= (ss <= ss_lim[:, None, :]).all(axis=2)
    if not ok.any():
        return False
    # candidate stage times: the current ones plus the moved samples' deltas
    cf = np.broadcast_to(fwd[:, None], (r_count, k_count, m, fwd.shape[2])).copy()
    cb = np.broadcast_to(bwd[:, None], cf.shape).copy()
    for s_idx, old_e, old_l, new_e, new_l2, on in (
        (a, ea, la, na_e, na_l, ok),
        (b, eb_, lb_, nb_e, nb_l, ok & moved_b),
    ):
        w = on[..., None].astype(np.float64)
        e_c, f_c, b_c = ef[rk, s_idx] * w, lf[rk, s_idx] * w, lb[rk, s_idx] * w
        for idx_, val, arr in (
            (old_e, -e_c, cf),
            (new_e, e_c, cf),
            (old_l, -f_c, cf),
            (new_l2, f_c, cf),
            (old_l, -b_c, cb),
            (new_l2, b_c, cb),
        ):
            arr[rk3, kk, idx_.ravel()] += val.reshape(-1, val.shape[-1])
    t = np.where(ok, _replica_times(cf, cb), np.inf)
    best = np.argmin(t, axis=1)
    gain = t[rows, best] < cur * (1 - 1e-9)
    if not gain.any():
        return False
    g = rows[gain]
    bk = best[gain]
    _apply(eidx, lidx, g, bk, a, b, moved_b, na_e, na_l, nb_e, nb_l)
    fwd[g], bwd[g] = cf[g, bk], cb[g, bk]
    mod[g] = cm[g, bk]
    t_load[g] = t_new[g, bk]
    l_count[g] = c_new[g, bk]
    if use_pcap:
        p_load[g] = p_new[g, bk]
    if use_budget:
        waiting[g] = w_new[g, bk]
    cur[g] = t[g, bk]
    return True
