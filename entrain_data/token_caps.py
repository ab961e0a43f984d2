"""The LLM token cap of a microbatch and the deferral budget: derived so that a plan made from an
index serves every global batch of it, or refused at plan time when the user pins a cap that
some sample or heavy batch exceeds (rather than a service that dies mid-epoch)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import InvalidInput, PlanError

__all__ = [
    "token_caps",
    "cap_rule",
    "share_need",
    "count_floor",
    "heavy_batches",
    "check_token_cap",
    "pinned_cap_error",
]

# share of a replica's sets the counting floor keeps free of the samples it counts: room for
# the other cap's large samples (a document page of many tokens and a large image cannot
# share a set) and for level 1, which splits the batch by work, not by size
_FREE_SETS = 1 / 8


def share_need(heavy: int, largest: int, dp: int, m: int) -> int:
    """Tokens per microbatch that ``m`` microbatches need to hold a replica's share of a global
    batch of ``heavy`` tokens, plus one sample (``largest``) of split imbalance."""
    return int(math.ceil((heavy / dp + largest) / m))


def count_floor(desc: np.ndarray | None, sets: int, free: float = _FREE_SETS) -> int:
    """The smallest cap at which ``sets`` sets hold samples of these sizes by counting alone.

    ``desc``: a batch's sizes sorted largest first (or, over several batches, the elementwise
    largest of their sorted sizes). A set holds at most ``j`` samples larger than
    ``cap / (j + 1)``, so a batch with more than ``j * sets`` of them cannot be served however
    the sets are cut: 132 document images each above half a 1.5x-mean patch cap in 128 sets
    (text-heavy documents, images capped at 1280 tokens, 512 samples in 4 x 32 sets). Those
    samples may fill ``1 - free`` of the sets' room (7/8 by default, see ``_FREE_SETS``; with
    ``free=0`` the floor is a strict bound: below it no cut serves the batch); the floor is the
    cap at which they do. 0 without sizes."""
    if desc is None or len(desc) == 0 or sets < 1:
        return 0
    room = max(1, int(sets * (1 - free)))
    j = np.arange(1, (len(desc) - 1) // room + 1)
    if not len(j):
        return 0
    return int(((j + 1) * np.asarray(desc)[j * room]).max())


def token_caps(
    heavy: int, largest: int, dp: int, m: int, pinned: int | None, floor: int = 0
) -> tuple[int, int]:
    """(cap, deferral budget) for ``dp`` replicas of ``m`` microbatches.

    The cap leaves 1.5x the heaviest batch's mean microbatch so the assignment has room to
    balance cost (not tokens), never falls below the largest sample (no sample may be
    unassignable), holds a replica's share of the heaviest batch (:func:`share_need`) and
    is at least ``floor`` (:func:`count_floor` of the batches' sizes for ``dp * m`` sets).
    The deferral budget buffers about two mean microbatches of encoder output.
    """
    budget = int(math.ceil(2 * heavy / (dp * m)))
    if pinned is not None:
        return pinned, budget
    return int(math.ceil(cap_rule(heavy, largest, dp, m, floor) / 256) * 256), budget


def cap_rule(heavy: int, largest: int, dp: int, m: int, floor: int = 0) -> int:
    """The cap's rule before alignment, for LLM tokens or encoder patches alike: 1.5x the
    heaviest batch's mean set, the largest sample, a replica's share (:func:`share_need`)
    and ``floor`` (:func:`count_floor`), whichever is largest."""
    return max(
        largest, int(math.ceil(1.5 * (heavy / (dp * m)))), share_need(heavy, largest, dp, m), floor
    )


def _shuffled_batches(n: int, global_batch: int, seed: int, epochs: int):
    """[per_epoch, global_batch] row indices of each of ``epochs`` seeded shuffles (at most
    ~4M samples drawn): the batches the service will cut, not only the profiled few."""
    per_epoch = n // global_batch
    epochs = max(1, min(epochs, (4 << 20) // max(n, 1)))
    rng = np.random.default_rng([int(seed), 0x7C0])
    for _ in range(epochs):
        yield rng.permutation(n)[: per_epoch * global_batch].reshape(per_epoch, global_batch)


def heavy_batches(
    sizes: np.ndarray, global_batch: int, seed: int, epochs: int = 8
) -> tuple[int, np.ndarray]:
    """Over ``epochs`` seeded shuffles of the table, in one pass: the heaviest global batch's
    total size (LLM tokens, or encoder patches) and [global_batch] the elementwise largest of
    the batches' sizes sorted largest first (what :func:`count_floor` reads)."""
    n = len(sizes)
    order = np.zeros(max(global_batch, 0), dtype=np.int64)
    if n == 0 or global_batch < 1:
        return 0, order
    if n < global_batch:
        order[:n] = -np.sort(-np.asarray(sizes, dtype=np.int64))
        return int(np.sum(sizes)), order
    heavy = 0
    for b in _shuffled_batches(n, global_batch, seed, epochs):
        heavy = max(heavy, int(sizes[b].sum(axis=1).max()))
        order = np.maximum(order, (-np.sort(-sizes[b], axis=1)).max(axis=0))
    return heavy, order


def check_token_cap(keys: Sequence, tok: np.ndarray, max_tokens: int | None) -> None:
    """A pinned token cap must hold every sample: name the ones it does not."""
    if max_tokens is None:
        return
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidInput(f"max_tokens must be a positive integer, got {max_tokens!r}")
    over = np.flatnonzero(tok > max_tokens)
    if len(over):
        worst = over[np.argsort(-tok[over])][:5]
        named = ", ".join(f"{keys[i]} ({int(tok[i])} tokens)" for i in worst)
        raise PlanError(
            f"max_tokens {max_tokens}: {len(over)} sample(s) of the index are longer: {named}"
            f"{' ...' if len(over) > 5 else ''}; raise max_tokens to at least {int(tok.max())} "
            "or drop those samples from the index"
        )


def pinned_cap_error(
    max_tokens: int, need: int, dp: int, m: int, microbatches_pinned: bool
) -> PlanError:
    """Why a pinned token cap fits no layout, said at plan time, not mid-epoch: ``need`` is the
    least any searched layout needs (at ``dp`` replicas of ``m`` microbatches, the most
    microbatches the search tried unless the user pinned them)."""
    where = (
        f"at dp={dp} with the pinned microbatches={m}"
        if microbatches_pinned
        else f"even at the most microbatches searched (dp={dp}, microbatches={m})"
    )
    return PlanError(
        f"max_tokens {max_tokens}: a heavy global batch of this index needs up to {need} LLM "
        f"tokens per microbatch {where}; raise max_tokens to at least {need} or pin more "
        "microbatches"
    )
