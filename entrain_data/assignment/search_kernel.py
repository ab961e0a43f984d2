"""Compiled rounds of the pipeline search and the 1F1B recurrence (numba, when installed).

The numpy search (:func:`.pipeline_search.refine_by_pipeline`) evaluates a round's
candidate moves as ~100 array operations over a few hundred elements each: numpy's
per-call cost, not arithmetic, is its time. Here the same round runs as one loop,
replica by replica, candidate by candidate. Results are identical to the numpy path,
not merely close: the random draws stay in the caller, every incremental update is
applied in the numpy path's order (so each float sum rounds the same way), and the
simulation performs the same max/+ sequence. ``tests/test_compiled.py`` compares
the two paths bit for bit.

Imported only where :func:`entrain_data.compiled.enabled` (numba installed, not switched off); the
callers take their numpy path otherwise.
"""

from __future__ import annotations

import numpy as np

from ..compiled import jit

__all__ = [
    "deal_light",
    "proxy_loads",
    "recurrence",
    "search_round",
    "shared_recurrence",
    "stage_parts",
]


@jit
def _ops(topo, m, s_count):
    """The schedule ``topo`` [N, 3] (stage, kind, microbatch) as the recurrence reads it:
    per op the op before it on its stage and the op it waits for (``N``: none; the run's
    ends carry a 0 there), where its time sits in a [2, M, S] forward-then-backward array
    (flat), and each stage's last op. One array read per operand instead of a branch on
    the op's kind: the same maxima and sums in the same order, so the same ends."""
    n = topo.shape[0]
    at = np.full((s_count, 2, m), n, np.int64)  # op index of (stage, kind, microbatch)
    for i in range(n):
        at[topo[i, 0], topo[i, 1], topo[i, 2]] = i
    prev = np.empty(n, np.int64)
    dep = np.empty(n, np.int64)
    load = np.empty(n, np.int64)
    last = np.full(s_count, n, np.int64)
    for i in range(n):
        s, kind, j = topo[i, 0], topo[i, 1], topo[i, 2]
        prev[i] = last[s]
        last[s] = i
        if kind == 0:
            dep[i] = at[s - 1, 0, j] if s > 0 else n
        else:
            dep[i] = at[s + 1, 1, j] if s < s_count - 1 else at[s, 0, j]
        load[i] = (kind * m + j) * s_count + s
    return prev, dep, load, last


@jit
def _first_ops(topo, m):
    """[M] the index of every microbatch's first op in the schedule ``topo`` [N, 3]: a run
    that changes microbatches from j on may start there (the ops before end alike)."""
    first = np.full(m, topo.shape[0], np.int64)
    for i in range(topo.shape[0]):
        first[topo[i, 2]] = min(first[topo[i, 2]], i)
    return first


@jit
def _run(prev, dep, load, last, times, ends):
    """The 1F1B iteration time of ``times`` (the [2 M S] flat forward-then-backward times,
    clipped at 0 as the search's caller does: incremental updates leave rounding residue)
    by the recurrence of :func:`entrain_data.simulator.simulate_pipeline` (``ends`` [N + 1]
    scratch, 0 at N). The search's rounds run their candidates one by one: their checks,
    not their runs, are a round's time (side by side, :func:`_run_lanes`, they took as long
    at 8192 / dp 128)."""
    for i in range(prev.shape[0]):
        ends[i] = max(ends[prev[i]], ends[dep[i]]) + max(times[load[i]], 0.0)
    t = ends[last[0]]
    for s in range(1, last.shape[0]):
        t = max(t, ends[last[s]])
    return t


_LANES = 8  # 1F1B runs evaluated side by side (:func:`_run_lanes`)


@jit(inline=True)
def _run_lanes(prev, dep, load, last, times, ends, count, out, start):
    """``out[c]``: the 1F1B iteration time of column ``c < count`` of ``times`` [2 M S,
    _LANES] (forward-then-backward, flat; clipped at 0: incremental updates leave rounding
    residue) by the recurrence of :func:`entrain_data.simulator.simulate_pipeline`, from op
    ``start`` on; ``ends`` [N + 1, _LANES]: the ends of the ops before it (0 in row N).

    One run is a chain of dependent maxima and sums: the CPU waits on each op's operands.
    Runs side by side fill those waits and vectorise, every lane the same max/+ sequence as
    one run alone (so the same times, bit for bit): on the light work's probes at 8192 / dp
    128, 2.4x faster than one run after another from the first op each changes."""
    for i in range(start, prev.shape[0]):
        p, d, x = prev[i], dep[i], load[i]
        for c in range(count):
            ends[i, c] = max(ends[p, c], ends[d, c]) + max(times[x, c], 0.0)
    for c in range(count):
        t = ends[last[0], c]
        for s in range(1, last.shape[0]):
            t = max(t, ends[last[s], c])
        out[c] = t


@jit
def _lanes(topo, m, s_count):
    """The schedule's arrays (:func:`_ops`) and the scratch of :func:`_run_lanes`: times,
    ends, the lanes' times and what each lane holds."""
    prev, dep, load, last = _ops(topo, m, s_count)
    times = np.empty((2 * m * s_count, _LANES))
    ends = np.zeros((topo.shape[0] + 1, _LANES))
    return prev, dep, load, last, times, ends, np.empty(_LANES), np.empty(_LANES, np.int64)


@jit(inline=True)
def _fill_lane(times, c, fwd, bwd):
    """Column ``c`` of the lanes' ``times``: the [M, S] forward and backward loads."""
    m, s_count = fwd.shape
    for j in range(m):
        for s in range(s_count):
            times[j * s_count + s, c] = fwd[j, s]
            times[(m + j) * s_count + s, c] = bwd[j, s]


@jit(inline=True)
def _run_changes(prev, dep, load, last, lanes, ends, lane_t, held, base, rows, loads, starts,
                 got):  # fmt: skip
    """``got[p]``: the 1F1B time of ``base`` [2, M, S] (forward and backward loads) with
    microbatches ``rows[p]`` ([2], -1: none) given ``loads[p]`` ([2, 2, S]), run from op
    ``starts[p]`` on. Every lane first holds ``base`` and its run; the changes then run side
    by side, latest start first, a batch from its earliest start (the ops before it end as
    ``base``'s run: the batches before it, starting later, wrote none of them), and each
    lane's rows are put back after."""
    m = base.shape[1]
    for c in range(_LANES):
        _fill_lane(lanes, c, base[0], base[1])
    _run_lanes(prev, dep, load, last, lanes, ends, _LANES, lane_t, 0)
    order = np.argsort(-starts, kind="mergesort")
    count = 0
    for i in range(order.shape[0]):
        p = order[i]
        for h in range(2):
            if rows[p, h] >= 0:
                _put_row(lanes, count, loads[p, h], rows[p, h], m)
        held[count] = p
        count += 1
        if count == _LANES or i == order.shape[0] - 1:
            _run_lanes(prev, dep, load, last, lanes, ends, count, lane_t, starts[held[count - 1]])
            for c in range(count):
                got[held[c]] = lane_t[c]
                for h in range(2):
                    j = rows[held[c], h]
                    if j >= 0:
                        _put_row(lanes, c, base[:, j], j, m)
            count = 0


@jit(inline=True)
def _put_row(lanes, c, row, j, m):
    """Microbatch ``j`` of lane ``c``: the forward and backward loads ``row`` [2, S]."""
    s_count = row.shape[1]
    for s in range(s_count):
        lanes[j * s_count + s, c] = row[0, s]
        lanes[(m + j) * s_count + s, c] = row[1, s]


@jit
def recurrence(fwd, bwd, topo):
    """[R] iteration times of [R, M, S] forward and backward times (inputs >= 0)."""
    r_count, m, s_count = fwd.shape
    prev, dep, load, last, times, ends, lane_t, held = _lanes(topo, m, s_count)
    out = np.empty(r_count)
    for r0 in range(0, r_count, _LANES):
        count = min(_LANES, r_count - r0)
        for c in range(count):
            _fill_lane(times, c, fwd[r0 + c], bwd[r0 + c])
        _run_lanes(prev, dep, load, last, times, ends, count, lane_t, 0)
        out[r0 : r0 + count] = lane_t[:count]
    return out


@jit
def shared_recurrence(mm_f, mm_b, l_last, sh_l, fs, bs, topo):
    """[R] iteration times of the forward loads ``mm_f + fs * (l_last * sh_l)`` and the
    backward loads ``mm_b + bs * (l_last * sh_l)`` ([R, M, S]; ``l_last`` [R, M] the LLM's
    per-microbatch load, ``sh_l`` [S] its share on each stage): the stage loads of
    :func:`.pipeline_search.depth_blind_pricer` built in the lanes, with its products and
    sums, instead of as five [R, M, S] arrays first (two thirds of a price's time at 65536 /
    dp 1024)."""
    r_count, m, s_count = mm_f.shape
    prev, dep, load, last, times, ends, lane_t, held = _lanes(topo, m, s_count)
    out = np.empty(r_count)
    for r0 in range(0, r_count, _LANES):
        count = min(_LANES, r_count - r0)
        for c in range(count):
            r = r0 + c
            for j in range(m):
                for s in range(s_count):
                    l_stage = l_last[r, j] * sh_l[s]
                    times[j * s_count + s, c] = mm_f[r, j, s] + fs * l_stage
                    times[(m + j) * s_count + s, c] = mm_b[r, j, s] + bs * l_stage
        _run_lanes(prev, dep, load, last, times, ends, count, lane_t, 0)
        out[r0 : r0 + count] = lane_t[:count]
    return out


@jit
def stage_parts(e_f, e_b, llm, sh_l, valid, fs, bs, trainable):
    """(ef, lf, lb) [R, n, S] of :func:`.pipeline_search._per_stage` from its products
    ``e_f`` (the encoders' stage costs, or their forward's where frozen) and ``e_b`` (their
    backward's; read only where frozen): the same products and sums in one pass, instead of
    six [R, n, S] arrays (its masks and scalings, half its time at 65536 / dp 1024)."""
    r_count, n, s_count = e_f.shape
    ef = np.zeros((r_count, n, s_count))
    lf = np.zeros((r_count, n, s_count))
    lb = np.zeros((r_count, n, s_count))
    for r in range(r_count):
        for i in range(n):
            if not valid[r, i]:
                continue
            for s in range(s_count):
                l_stage = llm[r, i] * sh_l[s]
                lf[r, i, s] = fs * l_stage
                if trainable:
                    ef[r, i, s] = fs * e_f[r, i, s]
                    lb[r, i, s] = bs * (e_f[r, i, s] + l_stage)
                else:
                    ef[r, i, s] = e_f[r, i, s]
                    lb[r, i, s] = e_b[r, i, s] + bs * l_stage
    return ef, lf, lb


@jit
def proxy_loads(eidx, lidx, ef, lf, lb, valid, m):
    """[R, M, S] forward and backward proxy loads of :func:`.pipeline_search._proxy_loads`:
    the three slot sums in one pass over the members (each in member order, as
    :func:`.common.slot_sums` adds them), the forward the E sets' sum plus the L sets'."""
    r_count, n, s_count = ef.shape
    fe = np.zeros((r_count, m, s_count))
    fl = np.zeros((r_count, m, s_count))
    bl = np.zeros((r_count, m, s_count))
    for r in range(r_count):
        for i in range(n):
            if not valid[r, i]:
                continue
            j = eidx[r, i]
            if j >= 0:
                for s in range(s_count):
                    fe[r, j, s] += ef[r, i, s]
            k = lidx[r, i]
            if k >= 0:
                for s in range(s_count):
                    fl[r, k, s] += lf[r, i, s]
                    bl[r, k, s] += lb[r, i, s]
    return fe + fl, bl


@jit
def deal_light(
    order, left, cols, weight, tok_s, pat_s, target, load, tok, pat, count, cap, pcap, slot
):
    """:func:`.light_work._deal`'s loop, replica by replica: every light sample (``order``
    [R, n], the first ``left`` [R] of each row) into the allowed microbatch whose deficits
    (``target`` less ``load`` [R, m, D], weighed by the sample's ``weight`` [R, n, D]) its
    ``cols`` [R, n, D] fill most; ``load``, ``tok``, ``pat``, ``count`` and ``slot`` [R, n]
    updated in place, in the numpy loop's order (so every sum rounds the same)."""
    r_count, m = target.shape[0], target.shape[1]
    d_count = target.shape[2]
    pe = pat.shape[2]
    allowed = np.empty(m, np.bool_)
    for r in range(r_count):
        for k in range(left[r]):
            s = order[r, k]
            empties = 0
            for j in range(m):
                if count[r, j] < 0.5:
                    empties += 1
            must = left[r] - k <= empties
            any_ok = False
            for j in range(m):
                if must:
                    ok = count[r, j] < 0.5
                else:
                    ok = tok[r, j] + tok_s[r, s] <= cap
                    for e in range(pe):
                        ok = ok and pat[r, j, e] + pat_s[r, s, e] <= pcap[e]
                allowed[j] = ok
                any_ok = any_ok or ok
            best, best_gap = 0, -np.inf
            for j in range(m):
                gap = -np.inf
                if allowed[j] or not any_ok:
                    gap = (target[r, j, 0] - load[r, j, 0]) * weight[r, s, 0]
                    for d in range(1, d_count):
                        gap += (target[r, j, d] - load[r, j, d]) * weight[r, s, d]
                if gap > best_gap:
                    best, best_gap = j, gap
            slot[r, s] = best
            for d in range(d_count):
                load[r, best, d] += cols[r, s, d]
            tok[r, best] += tok_s[r, s]
            for e in range(pe):
                pat[r, best, e] += pat_s[r, s, e]
            count[r, best] += 1


@jit
def search_round(
    a, b, kind, u,  # [R, K] drawn by the caller: samples, move kinds, positions
    eidx, lidx, has_enc, tok, wait_tok, p_samp, ef, lf, lb, mod_e, llm,  # per sample
    fwd, bwd, mod, t_load, l_count, p_load, waiting, cur,  # per replica state, updated
    ss_lim, cap_v, bud_v, pcap, use_pcap, use_budget, topo,
):  # fmt: skip
    """One round of :func:`.pipeline_search.refine_by_pipeline` for every replica: the same
    candidates, checks and acceptance, state updated in place. True if any replica moved."""
    r_count, k_count = a.shape
    m, s_count = fwd.shape[1], fwd.shape[2]
    e_count = mod_e.shape[2]
    km = mod.shape[2]
    pe = p_samp.shape[2]
    t_new = np.empty(m, np.int64)
    c_new = np.empty(m, np.int64)
    p_new = np.empty((m, pe), np.int64)
    w_new = np.empty(m, np.int64)
    cm = np.empty((m, km))
    cfb = np.empty((2, m, s_count))  # a candidate's forward and backward stage times
    cf, cb, flat = cfb[0], cfb[1], cfb.reshape(-1)
    prev, dep, load, last = _ops(topo, m, s_count)
    ends = np.zeros(topo.shape[0] + 1)
    best_t_new = np.empty(m, np.int64)
    best_c_new = np.empty(m, np.int64)
    best_p_new = np.empty((m, pe), np.int64)
    best_w_new = np.empty(m, np.int64)
    best_cm = np.empty((m, km))
    best_cf = np.empty((m, s_count))
    best_cb = np.empty((m, s_count))
    ss = np.empty(km)
    moved = False
    for r in range(r_count):
        best_t = np.inf
        best_k = -1
        b_na_e = b_na_l = b_nb_e = b_nb_l = 0
        b_moved_b = False
        for k in range(k_count):
            ai, bi, kd, uu = a[r, k], b[r, k], kind[r, k], u[r, k]
            ea, la, eb, lbb = eidx[r, ai], lidx[r, ai], eidx[r, bi], lidx[r, bi]
            enc_a = has_enc[r, ai]
            if enc_a:
                new_l = ea + np.int64(uu * (m - ea))
                new_e_move = np.int64(uu * (la + 1))
            else:
                new_l = np.int64(uu * m)
                new_e_move = new_l
            if kd == 0:
                na_e, na_l = (ea if enc_a else new_l), new_l
            elif kd == 1:
                na_e, na_l = new_e_move, (la if enc_a else new_e_move)
            else:
                na_e, na_l = eb, lbb
            swap = kd == 2
            nb_e, nb_l = (ea, la) if swap else (eb, lbb)
            if not enc_a:
                na_e = na_l
            if not has_enc[r, bi]:
                nb_e = nb_l
            moved_b = swap and ai != bi
            if na_e == ea and na_l == la:
                continue  # not a move
            # token cap and no empty L set
            for j in range(m):
                t_new[j] = t_load[r, j]
                c_new[j] = l_count[r, j]
            t_new[la] -= tok[r, ai]
            t_new[na_l] += tok[r, ai]
            c_new[la] -= 1
            c_new[na_l] += 1
            if moved_b:
                t_new[lbb] -= tok[r, bi]
                t_new[nb_l] += tok[r, bi]
                c_new[lbb] -= 1
                c_new[nb_l] += 1
            ok = True
            for j in range(m):
                if t_new[j] > cap_v[r] or c_new[j] < min(l_count[r, j], 1):
                    ok = False
            if not ok:
                continue
            # patch cap on the E sets
            for j in range(m):
                for q in range(pe):
                    p_new[j, q] = p_load[r, j, q]
            for q in range(pe):
                p_new[ea, q] -= p_samp[r, ai, q]
                p_new[na_e, q] += p_samp[r, ai, q]
                if moved_b:
                    p_new[eb, q] -= p_samp[r, bi, q]
                    p_new[nb_e, q] += p_samp[r, bi, q]
            if use_pcap:
                for j in range(m):
                    for q in range(pe):
                        if p_new[j, q] > pcap[r, q]:
                            ok = False
                if not ok:
                    continue
            # deferral budget after every boundary
            wa, wb = wait_tok[r, ai], wait_tok[r, bi]
            for j in range(m):
                w = waiting[r, j]
                if ea <= j < la:
                    w -= wa
                if na_e <= j < na_l:
                    w += wa
                if moved_b:
                    if eb <= j < lbb:
                        w -= wb
                    if nb_e <= j < nb_l:
                        w += wb
                w_new[j] = w
                if use_budget and w > bud_v:
                    ok = False
            if not ok:
                continue
            # per-module CV limits: the numpy path's update order, cell by cell
            for j in range(m):
                for c in range(km):
                    cm[j, c] = mod[r, j, c]
            for c in range(e_count):
                cm[ea, c] += -mod_e[r, ai, c]
                cm[na_e, c] += mod_e[r, ai, c]
            cm[la, e_count] += -llm[r, ai]
            cm[na_l, e_count] += llm[r, ai]
            if moved_b:
                for c in range(e_count):
                    cm[eb, c] += -mod_e[r, bi, c]
                    cm[nb_e, c] += mod_e[r, bi, c]
                cm[lbb, e_count] += -llm[r, bi]
                cm[nb_l, e_count] += llm[r, bi]
            for c in range(km):
                ss[c] = cm[0, c] * cm[0, c]
            for j in range(1, m):
                for c in range(km):
                    ss[c] += cm[j, c] * cm[j, c]
            for c in range(km):
                if ss[c] > ss_lim[r, c]:
                    ok = False
            if not ok:
                continue
            # stage times with the moved samples' deltas, then the simulated iteration
            for j in range(m):
                for s in range(s_count):
                    cf[j, s] = fwd[r, j, s]
                    cb[j, s] = bwd[r, j, s]
            for s in range(s_count):
                cf[ea, s] += -ef[r, ai, s]
                cf[na_e, s] += ef[r, ai, s]
                cf[la, s] += -lf[r, ai, s]
                cf[na_l, s] += lf[r, ai, s]
                cb[la, s] += -lb[r, ai, s]
                cb[na_l, s] += lb[r, ai, s]
            if moved_b:
                for s in range(s_count):
                    cf[eb, s] += -ef[r, bi, s]
                    cf[nb_e, s] += ef[r, bi, s]
                    cf[lbb, s] += -lf[r, bi, s]
                    cf[nb_l, s] += lf[r, bi, s]
                    cb[lbb, s] += -lb[r, bi, s]
                    cb[nb_l, s] += lb[r, bi, s]
            t = _run(prev, dep, load, last, flat, ends)
            if t < best_t:  # the first of equal times, as argmin
                best_t, best_k = t, k
                b_na_e, b_na_l, b_nb_e, b_nb_l, b_moved_b = na_e, na_l, nb_e, nb_l, moved_b
                best_t_new[:] = t_new
                best_c_new[:] = c_new
                best_p_new[:, :] = p_new
                best_w_new[:] = w_new
                best_cm[:, :] = cm
                best_cf[:, :] = cf
                best_cb[:, :] = cb
        if best_k < 0 or not best_t < cur[r] * (1 - 1e-9):
            continue
        moved = True
        ai, bi = a[r, best_k], b[r, best_k]
        eidx[r, ai], lidx[r, ai] = b_na_e, b_na_l
        if b_moved_b:
            eidx[r, bi], lidx[r, bi] = b_nb_e, b_nb_l
        fwd[r] = best_cf
        bwd[r] = best_cb
        mod[r] = best_cm
        t_load[r] = best_t_new
        l_count[r] = best_c_new
        if use_pcap:
            p_load[r] = best_p_new
        if use_budget:
            waiting[r] = best_w_new
        cur[r] = best_t
    return moved
