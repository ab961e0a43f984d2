"""Microbatch assignment: Entrain's hierarchical method and the peer baselines, one interface.

``assign`` is a pure function over arrays: per-sample encoder and LLM cost and
LLM tokens in, per replica and microbatch an encoder set and an LLM set out.
See :mod:`.entrain` for the method (with :mod:`.replica_split`, :mod:`.encoder_sets` and
:mod:`.llm_sets` for its levels) and :mod:`.baselines` for the peers.
"""

from __future__ import annotations

from collections.abc import Callable

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
from .common import Assignment, Inputs, check_assignment, validate_inputs
from .entrain import assign_entrain

__all__ = ["assign", "Assignment", "METHODS", "CAP_AWARE", "DEFERRING", "check_assignment"]

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
) -> Assignment:
    """Assign a global batch to ``dp`` replicas x ``microbatches`` encoder and LLM sets.

    ``encoder_cost`` is [B] or [B, E] (one column per encoder), ``llm_cost`` and
    ``tokens`` [B]. ``max_tokens`` caps the LLM tokens of an LLM set (a sample
    above it is an error); ``defer_budget`` caps the LLM tokens of samples
    encoded but not yet consumed at any microbatch boundary. Deterministic for
    (seed, iteration). ``flush`` marks the last iteration of a run or epoch: a
    method that carries work to the next iteration (``wlb_llm``) releases all
    of it here; the other methods ignore it. Raises :class:`~entrain_data.errors.InvalidInput` (a
    ``ValueError``) naming the problem on bad input.
    """
    if method not in METHODS:
        raise InvalidInput(
            f"unknown assignment method {method!r}; choose one of {', '.join(METHODS)}"
        )
    x = validate_inputs(encoder_cost, llm_cost, tokens, dp, microbatches, max_tokens, defer_budget)
    if method == "entrain":
        return assign_entrain(x, seed, iteration)
    if method == "wlb_llm":
        return assign_wlb_llm(x, flush=flush)
    return _BASELINES[method](x)
