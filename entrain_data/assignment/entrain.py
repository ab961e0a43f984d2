"""Entrain's hierarchical microbatch assignment (arXiv 2605.27918, section 4), vectorised.

Level 1 splits the global batch across DP replicas so that every replica's
*vector* of per-module sums (each encoder, the LLM) matches: greedy
largest-first placement in rounds, then pairwise swaps that shrink the worst
relative deviation on any module.

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

Samples without encoder work are never buffered: their encoder set is their
LLM set. A replica for which deferral cannot meet the cap or budget falls back
to joint sets (E_j == L_j) packed first-fit-decreasing under the cap, so the
invariants hold for every input the validation accepts, or a clear error says
why the cap cannot be met.

Below ``_SEARCH_BELOW`` samples the chosen sets are then refined against a
simulated 1F1B pipeline (:mod:`.pipeline_search`): whole-sample moves that
shorten a proxy pipeline's iteration while every module's per-microbatch CV
stays within a stated slack of the sets' own (4% encoders, 10% LLM).

The levels live in modules of their own: :mod:`.replica_split` (level 1),
:mod:`.encoder_sets` (E_j), :mod:`.llm_sets` (L_j) and :mod:`.pipeline_search`;
this module builds the level-2 candidates, scores them and picks one per replica:
among the candidates balanced within a stated share of the best (the sum of squared
per-module CVs), the one with the shortest proxy 1F1B iteration
(:func:`.pipeline_search.proxy_times`). Global batches from ``_ALL_CANDIDATES_BELOW``
samples build one candidate and skip the pick.
"""

from __future__ import annotations

import numpy as np

from .common import Assignment, Inputs, rng_for
from .encoder_sets import lpt_bins, order_by_llm, order_mountain, refine_bins, vector_bins
from .llm_sets import ffd_joint, fits_cap, llm_sets_fill, llm_sets_lpt
from .pipeline_search import proxy_times, refine_by_pipeline
from .replica_split import norm_columns, split_replicas

__all__ = ["assign_entrain", "split_replicas", "lpt_bins"]

_ALL_CANDIDATES_BELOW = 4096  # global batches this small try every level-2 candidate
_SEARCH_BELOW = 4096  # global batches this small refine the sets on a simulated pipeline
_MOUNTAIN = True
# candidates whose balance score is within this share of the best are ranked by proxy time
_TIME_PICK_SLACK = 0.6
_EDGE_WEIGHT = 0.05  # 1F1B fill/drain: a heavy first or last microbatch costs the whole pipe
_ENC_SLACK = 0.10  # a candidate's encoder CV may exceed the LPT sets' by this share


def _score(eidx, lidx, valid, enc_cols, llm, m):
    """[R] how unbalanced a candidate is: the sum over modules (each encoder from E, the
    LLM from L) of the squared CV of per-microbatch load, plus the worst peak/mean as a
    small tie-break. Squared CVs favour candidates with no badly balanced module.
    Also returns the worst encoder column's CV (encoder balance comes first)."""
    r_count = llm.shape[0]
    rr = np.broadcast_to(np.arange(r_count)[:, None], llm.shape)
    cols = [(eidx, enc_cols[..., e]) for e in range(enc_cols.shape[2])] + [(lidx, llm)]
    score = np.zeros(r_count)
    worst = np.zeros(r_count)
    enc_cv = np.zeros(r_count)
    for k, (idx, c) in enumerate(cols):
        ok = valid & (idx >= 0)
        loads = np.zeros((r_count, m))
        np.add.at(loads, (rr[ok], idx[ok]), c[ok])
        mean = loads.mean(axis=1)
        safe = np.where(mean > 0, mean, 1.0)
        cv = np.where(mean > 0, loads.std(axis=1) / safe, 0.0)
        score += cv**2
        if k < len(cols) - 1:
            enc_cv = np.maximum(enc_cv, cv)
        worst = np.maximum(worst, np.where(mean > 0, loads.max(axis=1) / safe, 1.0))
        edge = np.maximum(loads[:, 0], loads[:, -1]) / safe - 1.0
        score += _EDGE_WEIGHT * np.where(mean > 0, np.maximum(edge, 0.0), 0.0) / len(cols)
    return score + 1e-3 * worst, enc_cv


def assign_entrain(x: Inputs, seed: int, iteration: int, tolerance: float = 0.02) -> Assignment:
    """Entrain's two-level assignment of ``x`` (see the module docstring)."""
    rng = rng_for(seed, iteration, 1)
    r_count, m = x.dp, x.microbatches
    w = norm_columns(np.concatenate([x.enc, x.llm[:, None]], axis=1))
    members = split_replicas(w, r_count, rng)  # [R, n]
    valid = members >= 0
    safe = np.where(valid, members, 0)
    enc_cols = np.where(valid[..., None], x.enc[safe], 0.0)  # [R, n, E]
    enc_w = np.where(valid, norm_columns(x.enc)[safe].sum(axis=2), 0.0)  # [R, n]
    llm = np.where(valid, x.llm[safe], 0.0)
    tok = np.where(valid, x.tokens[safe], 0)
    has_enc = valid & (x.enc[safe].sum(axis=2) > 0)
    cap, budget = x.max_tokens, x.defer_budget

    # candidate A: encoder sets by LPT over encoder work alone, LLM sets by deferral
    ebin = lpt_bins(enc_w, has_enc, m)
    per_bin = members.shape[1] / m
    refine_bins(ebin, enc_w, has_enc, m, iters=2 * m if per_bin <= 16 else max(4, m // 2))
    eidx = (
        order_mountain(ebin, has_enc, enc_w, llm, m)
        if _MOUNTAIN
        else order_by_llm(ebin, has_enc, llm, m)
    )
    lidx2, failed2 = llm_sets_lpt(eidx, has_enc, valid, llm, tok, m, cap, budget)
    cands = [(eidx, lidx2, failed2)]
    if x.n < _ALL_CANDIDATES_BELOW:
        cands += _more_candidates(
            eidx, has_enc, valid, enc_cols, llm, tok, m, cap, budget, tolerance
        )
    eidx, lidx = _pick(cands, x, members, valid, has_enc, enc_cols, enc_w, llm, tok, m)
    if x.n < _SEARCH_BELOW:
        args = (valid, has_enc, enc_cols, llm, tok, m, cap, budget, rng_for(seed, iteration, 2))
        eidx, lidx = refine_by_pipeline(eidx, lidx, *args)
    return _to_assignment("entrain", members, valid, eidx, lidx, r_count, m)


def _more_candidates(eidx, has_enc, valid, enc_cols, llm, tok, m, cap, budget, tolerance):
    """The costlier candidates, tried where the batch is small enough to afford them."""
    lidx, failed = llm_sets_fill(eidx, has_enc, valid, llm, tok, m, cap, budget, tolerance)
    cands = [(eidx, lidx, failed)]
    # the same encoder sets, LLM-heaviest first: the most room for deferral
    ebin = np.where(has_enc, eidx, -1)
    eidx_d = order_by_llm(ebin, has_enc, llm, m)
    for builder in (llm_sets_fill, llm_sets_lpt):
        args = (eidx_d, has_enc, valid, llm, tok, m, cap, budget)
        lidx_d, failed_d = builder(*args, tolerance) if builder is llm_sets_fill else builder(*args)
        cands.append((eidx_d, lidx_d, failed_d))

    # candidate B: encoder sets balancing every encoder column, the LLM and tokens together
    # (vector LPT); their LLM sets are the encoder sets themselves or a deferral of them
    wv = np.concatenate([enc_cols, llm[..., None], tok[..., None].astype(np.float64)], axis=2)
    vb = order_by_llm(vector_bins(wv, valid, m), valid, llm, m)
    joint_ok = fits_cap(vb, valid, tok, m, cap)
    cands.append((vb, vb, ~joint_ok))
    # candidate C: joint sets balancing the LLM and tokens only (what the LLM peers aim at)
    wl = np.stack([llm, tok.astype(np.float64)], axis=2)
    lb = vector_bins(wl, valid, m)
    cands.append((lb, lb, ~fits_cap(lb, valid, tok, m, cap)))
    veidx = np.where(has_enc, vb, -1)
    lidx3, failed3 = llm_sets_lpt(veidx, has_enc, valid, llm, tok, m, cap, budget)
    cands.append((veidx, lidx3, failed3))
    return cands


def _pick(cands, x, members, valid, has_enc, enc_cols, enc_w, llm, tok, m):
    """Per replica one candidate ([R, n] E and L microbatch); replicas where none is usable
    (all break the cap or budget, or leave an LLM set empty) get joint FFD sets.

    Balance first: a candidate must keep the encoder sets within ``_ENC_SLACK`` of the
    LPT sets and score within ``_TIME_PICK_SLACK`` of the best-balanced candidate. Among
    those the shortest proxy 1F1B iteration wins: equal scores can hide where the heavy
    microbatches sit, and that is what the pipeline pays for."""
    r_count = x.dp
    enc_ref = None
    scored = []
    for ce, cl, cf in cands:
        e_eff = np.where(has_enc, ce, cl)
        sc, ecv = _score(e_eff, cl, valid, enc_cols, llm, m)
        if enc_ref is None:  # the first candidate's encoder sets are LPT-tight: the reference
            enc_ref = np.where(cf, np.inf, ecv)
        # the encoders produce at a constant rate first: no candidate may give that up
        sc = np.where(cf | (ecv > enc_ref * (1 + _ENC_SLACK) + 1e-3), np.inf, sc)
        scored.append((e_eff, cl, np.where(_empty_llm_set(cl, valid, m), np.inf, sc)))
    best_sc = np.min([sc for _, _, sc in scored], axis=0)
    best_key = np.full(r_count, np.inf)
    eidx = np.zeros_like(cands[0][0])
    lidx = np.zeros_like(eidx)
    for e_eff, cl, sc in scored:
        ok = np.isfinite(sc) & (sc <= best_sc * (1 + _TIME_PICK_SLACK) + 1e-12)
        if not ok.any():
            continue
        key = sc if len(scored) == 1 else proxy_times(e_eff, cl, valid, enc_cols, llm, m)
        key = np.where(ok, key, np.inf)
        better = key < best_key
        best_key = np.where(better, key, best_key)
        eidx = np.where(better[:, None], e_eff, eidx)
        lidx = np.where(better[:, None], cl, lidx)
    for r in np.flatnonzero(~np.isfinite(best_key)):
        v = valid[r]
        joint = ffd_joint(
            llm[r, v] + enc_w[r, v] * 1e-9, tok[r, v], m, x.max_tokens, f"replica {int(r)}"
        )
        eidx[r, v] = joint
        lidx[r, v] = joint
    return _edges_light(eidx, lidx, valid, enc_w, llm, m)


def _empty_llm_set(lidx, valid, m) -> np.ndarray:
    """[R] whether a replica with at least m samples leaves an LLM set empty."""
    r_count = lidx.shape[0]
    counts = np.zeros((r_count, m), np.int64)
    rr = np.broadcast_to(np.arange(r_count)[:, None], lidx.shape)
    ok = valid & (lidx >= 0)
    np.add.at(counts, (rr[ok], lidx[ok]), 1)
    return (counts == 0).any(axis=1) & (valid.sum(axis=1) >= m)


def _edges_light(eidx, lidx, valid, enc_w, llm, m):
    """Reorder the microbatches of replicas without deferral so the heaviest sit in the middle.

    1F1B pays the first microbatch's forward and the last one's backward across every
    stage (fill and drain) on top of the steady state; heavy microbatches there lengthen
    the iteration, in the middle they are absorbed. Replicas that defer keep their order:
    a permutation could put a sample's LLM set before its encoder set.
    """
    r_count = llm.shape[0]
    joint = ((eidx == lidx) | ~valid).all(axis=1)
    if not joint.any() or m < 3:
        return eidx, lidx
    rows = np.arange(r_count)[:, None]
    tot = enc_w / max(float(enc_w[valid].mean()), 1e-30) + llm / max(
        float(llm[valid].mean()), 1e-30
    )
    load = np.zeros((r_count, m))
    ok = valid & (lidx >= 0)
    np.add.at(load, (np.broadcast_to(rows, lidx.shape)[ok], lidx[ok]), tot[ok])
    # positions from the centre outwards: the heaviest microbatch gets the centre
    centre = (m - 1) / 2
    pos_order = np.argsort(np.abs(np.arange(m) - centre), kind="stable")
    heavy_first = np.argsort(-load, axis=1, kind="stable")  # [R, m] old bin ids
    newpos = np.empty((r_count, m), dtype=np.int64)
    np.put_along_axis(newpos, heavy_first, np.broadcast_to(pos_order, (r_count, m)), axis=1)
    remap = np.where(joint[:, None], newpos, np.arange(m)[None, :])
    e2 = np.where(valid, np.take_along_axis(remap, np.maximum(eidx, 0), axis=1), eidx)
    l2 = np.where(valid, np.take_along_axis(remap, np.maximum(lidx, 0), axis=1), lidx)
    return e2, l2


def _grouped(members: np.ndarray, slot: np.ndarray, count: int) -> list[np.ndarray]:
    """Members grouped by slot (0..count-1), ascending sample order inside a group."""
    order = np.lexsort((members, slot))
    bounds = np.searchsorted(slot[order], np.arange(count + 1))
    ms = members[order]
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
