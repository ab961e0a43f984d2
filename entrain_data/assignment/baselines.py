"""Peer baselines with Entrain's interface (E_j == L_j for all of them).

Each follows the published algorithm or code of its peer, adapted only where
the interface forces it (a fixed number of microbatches per replica); the
docstrings say what each follows and where it had to adapt.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..errors import InvalidInput
from .common import Assignment, Inputs
from .encoder_sets import lpt_bins
from .replica_split import split_replicas

__all__ = [
    "assign_sequential",
    "assign_megatron_dp_balanced",
    "assign_verl_kk",
    "assign_orchmllm",
    "assign_wlb_llm",
    "assign_disttrain",
    "karmarkar_karp",
    "VERL_WORKLOAD_LINEAR",
]

# verl's calculate_workload: 24576 * s + s^2 (the linear coefficient is verl's, for 7B-class models)
VERL_WORKLOAD_LINEAR = 24576.0


def _from_bins(
    method: str, r_count: int, m: int, rep: np.ndarray, mb: np.ndarray, carried=None
) -> Assignment:
    """Sets from per-sample (replica, microbatch); -1 = carried. Sets keep dataset order."""
    sets = [[np.zeros(0, np.int64) for _ in range(m)] for _ in range(r_count)]
    live = np.flatnonzero(rep >= 0)
    key = rep[live] * m + mb[live]
    order = live[np.argsort(key, kind="stable")]
    bounds = np.searchsorted(rep[order] * m + mb[order], np.arange(r_count * m + 1))
    for s in range(r_count * m):
        sets[s // m][s % m] = order[bounds[s] : bounds[s + 1]]
    copy = [[s.copy() for s in row] for row in sets]
    c = np.zeros(0, np.int64) if carried is None else np.asarray(carried, np.int64)
    return Assignment(method, r_count, m, sets, copy, c)


def assign_sequential(x: Inputs) -> Assignment:
    """Megatron-LM's default: each DP rank takes a contiguous slice of the global batch and
    cuts it into fixed-count microbatches in dataset order (no cost, no token cap)."""
    b, r_count, m = x.n, x.dp, x.microbatches
    rep = np.empty(b, np.int64)
    mb = np.empty(b, np.int64)
    for r, chunk in enumerate(np.array_split(np.arange(b), r_count)):
        rep[chunk] = r
        for j, sub in enumerate(np.array_split(chunk, m)):
            mb[sub] = j
    return _from_bins("sequential", r_count, m, rep, mb)


def _next_fit(tokens: np.ndarray, capacity: int) -> list[list[int]]:
    packs: list[list[int]] = []
    cur: list[int] = []
    s = 0
    for i, t in enumerate(tokens.tolist()):
        if cur and s + t > capacity:
            packs.append(cur)
            cur, s = [], 0
        cur.append(i)
        s += t
    if cur:
        packs.append(cur)
    return packs


def assign_megatron_dp_balanced(x: Inputs) -> Assignment:
    """Megatron-Core ``DpBalancedScheduler`` (sequence-packing scheduler): pack samples *in their
    original order* until the token capacity is reached; if the pack count is not a multiple of
    dp, move samples from the last packs into new packs; pack ``i * dp + r`` is microbatch i of
    DP rank r. Adaptation: Megatron fixes the capacity and lets the microbatch count float; the
    interface fixes dp * microbatches packs, so the capacity is the smallest one (at most
    ``max_tokens``) that yields no more packs than that, and the split step fills the rest."""
    b, r_count, m = x.n, x.dp, x.microbatches
    want = r_count * m
    lo = int(x.tokens.max()) if b else 1
    hi = int(x.tokens.sum())
    if x.max_tokens is not None:
        hi = min(hi, x.max_tokens)
        if len(_next_fit(x.tokens, hi)) > want:
            raise InvalidInput(
                f"megatron_dp_balanced: {int(x.tokens.sum())} tokens in original order need more than "
                f"{want} packs of max_tokens={x.max_tokens}"
            )
    lo = max(lo, 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_next_fit(x.tokens, mid)) <= want:
            hi = mid
        else:
            lo = mid + 1
    packs = _next_fit(x.tokens, lo)
    i = len(packs) - 1
    while len(packs) < want:  # Megatron's "move few samples to the end"
        while len(packs[i]) <= 1:
            i -= 1
        packs.append([packs[i].pop()])
    rep = np.empty(b, np.int64)
    mb = np.empty(b, np.int64)
    for p, members in enumerate(packs):
        rep[members] = p % r_count
        mb[members] = p // r_count
    return _from_bins("megatron_dp_balanced", r_count, m, rep, mb)


def karmarkar_karp(work: np.ndarray, k: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing method into ``k`` parts, as verl's ``get_seqlen_balanced_partitions``.

    With ``equal_size`` items are taken k at a time in sorted order so every part
    gets the same count (verl's construction).
    """
    order = np.argsort(-work, kind="stable")
    heap: list = []
    counter = 0
    if equal_size:
        if len(work) % k:
            raise InvalidInput(
                f"equal-size Karmarkar-Karp needs a multiple of {k} items, got {len(work)}"
            )
        for g in range(0, len(order), k):
            grp = order[g : g + k]
            sums = work[grp].astype(np.float64)
            parts = [[int(i)] for i in grp]
            heapq.heappush(heap, (-(sums.max() - sums.min()), counter, sums, parts))
            counter += 1
    else:
        for i in order:
            sums = np.zeros(k)
            sums[0] = work[i]
            parts = [[int(i)]] + [[] for _ in range(k - 1)]
            heapq.heappush(heap, (-(sums.max() - sums.min()), counter, sums, parts))
            counter += 1
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        o1 = np.argsort(-s1, kind="stable")  # largest of one with smallest of the other
        o2 = np.argsort(s2, kind="stable")
        sums = s1[o1] + s2[o2]
        parts = [p1[a] + p2[c] for a, c in zip(o1, o2)]
        heapq.heappush(heap, (-(sums.max() - sums.min()), counter, sums, parts))
        counter += 1
    return heap[0][3]


def assign_verl_kk(x: Inputs) -> Assignment:
    """verl ``seqlen_balancing``: Karmarkar-Karp partitioning of the workload ``a*s + s^2``
    (s = sequence tokens) across DP ranks with equal sample counts (``_balance_batch``), then
    into the microbatches of each rank as ``rearrange_micro_batches`` does
    (:func:`_verl_microbatches`). Adaptation: when the batch does not divide evenly, the
    remainder samples are dealt by the same method without the equal-size constraint; the
    microbatch count is the plan's, where verl derives it from a token budget."""
    b, r_count, m = x.n, x.dp, x.microbatches
    s = x.tokens.astype(np.float64)
    work = VERL_WORKLOAD_LINEAR * s + s * s
    rep = np.empty(b, np.int64)
    mb = np.empty(b, np.int64)
    for r, part in enumerate(_kk_parts(work, r_count)):
        part = np.sort(np.asarray(part, np.int64))
        rep[part] = r
        for j, sub in enumerate(_verl_microbatches(work[part], m)):
            mb[part[np.asarray(sub, np.int64)]] = j
    return _from_bins("verl_kk", r_count, m, rep, mb)


def _verl_microbatches(work: np.ndarray, m: int) -> list[list[int]]:
    """verl's ``rearrange_micro_batches``: Karmarkar-Karp without equal counts, then (its
    default ``use_dynamic_bsz_balance``) the parts sorted heaviest first and laid out as
    ``order[::2][::-1] + order[1::2]``, light microbatches at both ends of the pipeline.
    (The first audit of the peers found this step and the free counts missing: the peer ran
    up to 4% slower than verl does on heavy-tailed rows.) Where a part would be empty (fewer
    samples than microbatches, zero-work samples) the equal-count split stands in."""
    parts = karmarkar_karp(work, m, equal_size=False) if len(work) >= m else []
    if len(parts) != m or any(not p for p in parts):
        parts = _kk_parts(work, m)
    sums = [float(work[p].sum()) for p in parts]
    order = sorted(range(m), key=lambda i: sums[i], reverse=True)
    return [parts[i] for i in order[::2][::-1] + order[1::2]]


def _kk_parts(work: np.ndarray, k: int) -> list[list[int]]:
    n = len(work)
    even = (n // k) * k
    if even == n:
        return karmarkar_karp(work, k, equal_size=True)
    order = np.argsort(-work, kind="stable")
    head, tail = np.sort(order[:even]), np.sort(order[even:])
    parts = [[int(head[i]) for i in p] for p in karmarkar_karp(work[head], k, True)]
    sums = [float(work[p].sum()) for p in parts]
    for i in tail[np.argsort(-work[tail], kind="stable")]:
        j = int(np.argmin(sums))
        parts[j].append(int(i))
        sums[j] += float(work[i])
    return parts


def assign_orchmllm(x: Inputs) -> Assignment:
    """OrchMLLM batch post-balancing / Megatron-Bridge MIMO reorder: equal-count
    longest-processing-time placement across DP ranks on the per-phase cost, then equal-count
    microbatches. Adaptation: with E == L one placement must serve both phases, so the cost is
    the sum of the encoder and LLM phases."""
    r_count, m = x.dp, x.microbatches
    total = x.enc.sum(axis=1) + x.llm
    members = _equal_count_lpt(total, r_count)
    rep = np.empty(x.n, np.int64)
    mb = np.empty(x.n, np.int64)
    for r in range(r_count):
        mem = members[r][members[r] >= 0]
        rep[mem] = r
        sub = _equal_count_lpt(total[mem], m)
        for j in range(m):
            mb[mem[sub[j][sub[j] >= 0]]] = j
    return _from_bins("orchmllm", r_count, m, rep, mb)


def _equal_count_lpt(cost: np.ndarray, k: int) -> np.ndarray:
    """[k, ceil(n/k)] members (-1 pads): heaviest items first, one per part per round."""
    return split_replicas(cost[:, None], k, np.random.default_rng(0), swap_iters=0)


def assign_wlb_llm(x: Inputs, flush: bool = False) -> Assignment:
    """WLB-LLM (Wang et al., 2025, Algorithm 1) variable-length packing with outlier delay:
    samples whose workload exceeds half of a microbatch's mean workload go to an outlier queue;
    once the queue holds at least one per microbatch, that many (the oldest) are released into
    this iteration, the others wait (returned in ``carried``). The rest are placed largest first
    into the microbatch with the lowest workload that still fits the token cap. Workload:
    encoder + LLM cost. Adaptation: ``assign`` is stateless, so the queue is the batch's own
    outliers; the caller prepends ``carried`` to the next batch (oldest first). ``flush``:
    the run or epoch ends here, every queued outlier is released (one per microbatch while
    they last, then the rest by the same lowest-workload rule)."""
    b, r_count, m = x.n, x.dp, x.microbatches
    bins = r_count * m
    work = x.enc.sum(axis=1) + x.llm
    out_idx = np.flatnonzero(work > 0.5 * work.sum() / bins)
    if flush:
        carried = np.zeros(0, np.int64)
    elif len(out_idx) >= bins:  # the queue releases one outlier per microbatch, oldest first
        carried = out_idx[bins:]
    elif b - len(out_idx) >= bins:  # too few to spread: all wait in the queue
        carried = out_idx
    else:
        carried = np.zeros(0, np.int64)
    placed = np.setdiff1d(np.arange(b), carried)
    loads = np.zeros(bins)
    toks = np.zeros(bins, np.int64)
    cap = x.max_tokens
    slot = np.full(b, -1, np.int64)
    for i in placed[np.argsort(-work[placed], kind="stable")]:
        fits = np.ones(bins, bool) if cap is None else toks + x.tokens[i] <= cap
        if not fits.any():
            raise InvalidInput(
                f"wlb_llm: sample {int(i)} ({int(x.tokens[i])} tokens) fits no microbatch under max_tokens={cap}"
            )
        # lowest workload, and among equals the emptier bin (so no bin stays empty)
        s = int(np.argmin(np.where(fits, loads + toks * 1e-12, np.inf)))
        slot[i] = s
        loads[s] += work[i]
        toks[s] += x.tokens[i]
    rep = np.where(slot >= 0, slot % r_count, -1)
    mb = np.where(slot >= 0, slot // r_count, -1)
    return _from_bins("wlb_llm", r_count, m, rep, mb, carried)


def assign_disttrain(x: Inputs) -> Assignment:
    """DistTrain (arXiv 2408.04275) data reordering: intra-microbatch balancing by
    longest-processing-time across DP ranks, then inter-microbatch reordering inside the 1F1B
    pipeline. For the encoder -> LLM two-stage flow the reordering is Johnson's rule (the optimal
    order of a two-machine flow shop): microbatches whose encoder time is below their LLM time
    first, by ascending encoder time, then the rest by descending LLM time."""
    r_count, m = x.dp, x.microbatches
    enc = x.enc.sum(axis=1)
    w = np.stack([enc, x.llm], axis=1)
    w = w / np.where(w.mean(axis=0) > 0, w.mean(axis=0), 1.0)
    members = split_replicas(
        w.sum(axis=1)[:, None], r_count, np.random.default_rng(0), swap_iters=0
    )
    rep = np.empty(x.n, np.int64)
    mb = np.empty(x.n, np.int64)
    for r in range(r_count):
        mem = members[r][members[r] >= 0]
        rep[mem] = r
        bins = lpt_bins(w[mem].sum(axis=1)[None, :], np.ones((1, len(mem)), bool), m)[0]
        e_load = np.bincount(bins, weights=enc[mem], minlength=m)
        l_load = np.bincount(bins, weights=x.llm[mem], minlength=m)
        first = np.flatnonzero(e_load < l_load)
        rest = np.flatnonzero(e_load >= l_load)
        order = np.concatenate(
            [
                first[np.argsort(e_load[first], kind="stable")],
                rest[np.argsort(-l_load[rest], kind="stable")],
            ]
        )
        position = np.empty(m, np.int64)
        position[order] = np.arange(m)
        mb[mem] = position[bins]
    return _from_bins("disttrain", r_count, m, rep, mb)
