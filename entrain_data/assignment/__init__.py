"""Microbatch assignment: Entrain's hierarchical method and the peer baselines, one interface.

``assign`` is a pure function over arrays: per-sample encoder and LLM cost and
LLM tokens in, per replica and microbatch an encoder set and an LLM set out.
See :mod:`.entrain` for the method (with :mod:`.replica_split`, :mod:`.encoder_sets` and
:mod:`.llm_sets` for its levels) and :mod:`.baselines` for the peers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import InvalidInput
from .baselines import (
    assign_disttrain,
    assign_megatron_dp_balanced,
    assign_orchmllm,
    assign_sequential,
    assign_verl_kk,
    assign_wlb_llm,
)
from .common import Assignment, Inputs, check_assignment, validate_inputs, whole
from .delay import assign_delayed

__all__ = [
    "assign",
    "Assignment",
    "METHODS",
    "CAP_AWARE",
    "DEFERRING",
    "DELAYING",
    "PATCH_CAP_AWARE",
    "check_assignment",
]

METHODS = (
    "entrain",
    "sequential",
    "megatron_dp_balanced",
    "verl_kk",
    "orchmllm",
    "wlb_llm",
    "disttrain",
)
CAP_AWARE = frozenset({"entrain", "megatron_dp_balanced", "wlb_llm"})
"""Methods that honour ``max_tokens``; the others do not know a cap (as the peers they follow)."""
DEFERRING = frozenset({"entrain"})
"""Methods whose LLM sets may differ from their encoder sets (and so honour ``defer_budget``)."""
PATCH_CAP_AWARE = frozenset({"entrain"})
"""Methods that honour ``max_encoder_patches``."""
DELAYING = frozenset({"entrain"})
"""Methods that honour ``max_delay`` (``wlb_llm`` carries by its own, unbounded rule)."""

_BASELINES: dict[str, Callable[[Inputs], Assignment]] = {
    "sequential": assign_sequential,
    "megatron_dp_balanced": assign_megatron_dp_balanced,
    "verl_kk": assign_verl_kk,
    "orchmllm": assign_orchmllm,
    "wlb_llm": assign_wlb_llm,
    "disttrain": assign_disttrain,
}


def assign(
    encoder_cost: np.ndarray,
    llm_cost: np.ndarray,
    tokens: np.ndarray,
    *,
    dp: int,
    microbatches: int,
    max_tokens: int | None = None,
    defer_budget: int | None = None,
    method: str = "entrain",
    seed: int = 0,
    iteration: int = 0,
    flush: bool = False,
    encoder_patches: np.ndarray | None = None,
    max_encoder_patches: int | np.ndarray | None = None,
    max_delay: int = 0,
    ages: np.ndarray | None = None,
    frozen_encoders: bool | Sequence[bool] = False,
    pipeline_stages: int | None = None,
    stage_shares: np.ndarray | None = None,
) -> Assignment:
    """Assign a global batch to ``dp`` replicas x ``microbatches`` encoder and LLM sets.

    ``encoder_cost`` is [B] or [B, E] (one column per encoder), ``llm_cost`` and
    ``tokens`` [B]. ``max_tokens`` caps the LLM tokens of an LLM set (a sample
    above it is an error); ``defer_budget`` caps the LLM tokens of samples
    encoded but not yet consumed at any microbatch boundary. Deterministic for
    (seed, iteration). ``flush`` marks the last iteration of a run or epoch: a
    method that carries work to the next iteration (``wlb_llm``) releases all
    of it here; the other methods ignore it.

    ``encoder_patches`` ([B] or [B, E] integers, one column per encoder) with
    ``max_encoder_patches`` (one int, or one per encoder) caps the patches of every
    encoder set (entrain; a sample above the cap is an error). ``max_delay=K > 0``
    (entrain, opt-in): a heavy sample (and light ones riding with it, where the caps leave
    room) may wait up to K iterations (see :mod:`.delay`);
    the waiting ones are returned in ``carried`` and the caller prepends them to the
    next batch with ``ages`` (iterations each sample has waited so far) plus one.
    ``frozen_encoders`` (one bool, or one per encoder column) marks encoders that run
    forward only: entrain's pipeline proxy then puts all their work in the encoder set
    and none of it in the LLM set (a trainable encoder's backward runs with the sample's
    LLM microbatch); the other methods ignore it.
    ``pipeline_stages`` is the plan's pipeline depth (pp): entrain prices its candidates
    and searches on a proxy 1F1B pipeline of that many stages. Where the fill and drain
    fall differs with the depth: at 512 / dp 4 / 32 with 8 stages, the 4-stage proxy lost
    up to 2.1% to the best peer on rows that the right depth wins. None (the depth is not
    known): the pick prices each candidate on 2, 4 and 8 stages (the mean of its times
    relative to each depth's even pipeline) and the search runs on 4. The loader service
    passes its plan's pp; callers that know theirs should too. ``stage_shares`` ([S, E + 1],
    per stage each encoder column's share of that column's work, then the LLM's; every
    column sums to 1) is the plan's stage layout itself (:func:`~entrain_data.simulator.
    stage_shares`, stored in the plan): entrain's proxy pipeline then runs on the plan's
    stages instead of ones laid out from the batch's module totals, and S is the depth
    (``pipeline_stages``, if given too, must equal it). The loader service passes its
    plan's. The other methods ignore both.
    Raises :class:`~entrain_data.errors.InvalidInput` (a ``ValueError``) naming the
    problem on bad input.
    """
    if method not in METHODS:
        raise InvalidInput(
            f"unknown assignment method {method!r}; choose one of {', '.join(METHODS)}"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidInput(f"seed must be an integer, got {seed!r}")
    iteration = whole("iteration", iteration, 0)
    x = validate_inputs(
        encoder_cost,
        llm_cost,
        tokens,
        dp,
        microbatches,
        max_tokens,
        defer_budget,
        encoder_patches,
        max_encoder_patches,
        max_delay,
        ages,
        frozen_encoders,
        pipeline_stages,
        stage_shares,
    )
    if method == "entrain":
        return assign_delayed(x, seed, iteration, flush)
    if method == "wlb_llm":
        return assign_wlb_llm(x, flush=flush)
    return _BASELINES[method](x)
