"""The LLM token cap of a microbatch and the deferral budget: derived so that a plan made from an
index serves every global batch of it, or refused at plan time when the user pins a cap that
some sample or heavy batch exceeds (rather than a service that dies mid-epoch)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import InvalidInput, PlanError

__all__ = ["token_caps", "share_need", "heavy_batch_tokens", "check_token_cap", "pinned_cap_error"]


def share_need(heavy: int, largest: int, dp: int, m: int) -> int:
    """Tokens per microbatch that ``m`` microbatches need to hold a replica's share of a global
    batch of ``heavy`` tokens, plus one sample (``largest``) of split imbalance."""
    return int(math.ceil((heavy / dp + largest) / m))


def token_caps(heavy: int, largest: int, dp: int, m: int, pinned: int | None) -> tuple[int, int]:
    """(cap, deferral budget) for ``dp`` replicas of ``m`` microbatches.

    The cap leaves 1.5x the heaviest batch's mean microbatch so the assignment has room to
    balance cost (not tokens), never falls below the largest sample (no sample may be
    unassignable) and holds a replica's share of the heaviest batch (:func:`share_need`).
    The deferral budget buffers about two mean microbatches of encoder output.
    """
    per_mb = heavy / (dp * m)
    budget = int(math.ceil(2 * per_mb))
    if pinned is not None:
        return pinned, budget
    cap = max(largest, int(math.ceil(1.5 * per_mb)), share_need(heavy, largest, dp, m))
    return int(math.ceil(cap / 256) * 256), budget


def heavy_batch_tokens(tok: np.ndarray, global_batch: int, seed: int, epochs: int = 8) -> int:
    """LLM tokens of the heaviest global batch over ``epochs`` seeded shuffles of the table (at
    most ~4M samples drawn): the batches the service will cut, not only the profiled few."""
    n = len(tok)
    if n == 0 or global_batch < 1:
        return 0
    per_epoch = n // global_batch
    if per_epoch == 0:
        return int(tok.sum())
    epochs = max(1, min(epochs, (4 << 20) // n))
    rng = np.random.default_rng([int(seed), 0x7C0])
    heavy = 0
    for _ in range(epochs):
        order = rng.permutation(n)[: per_epoch * global_batch]
        heavy = max(heavy, int(tok[order].reshape(per_epoch, global_batch).sum(axis=1).max()))
    return heavy


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


def pinned_cap_error(max_tokens: int, need: int, dp: int | None, m: int | None) -> PlanError:
    """Why a pinned token cap fits no layout: said at plan time, not mid-epoch."""
    return PlanError(
        f"max_tokens {max_tokens}: a heavy global batch of this index needs up to {need} LLM "
        f"tokens per microbatch at dp={dp or 1}, microbatches={m or 1}, and no layout with more "
        "microbatches fits either; raise max_tokens or pin more microbatches"
    )
