"""Group-wide encoder calls per microbatch: what sharded data parallelism needs from the schedule.

When a module's parameters are sharded over the data-parallel group (DeepSpeed
ZeRO-3, FSDP2 with per-block wrapping), each call of it all-gathers its
parameters in forward and again in backward, and every rank of the group must
take part in the same collectives in the same order. Balanced microbatches
with deferral make replicas call an encoder a different number of times: one
call for the samples its LLM consumes in the same microbatch, one per later
consuming microbatch for deferred samples (their backward runs with that
consumer's). So every rank makes the *union* over the group of those calls,
each a *group* ``(j, c)`` (encoded in microbatch j, consumed in c), padding the
ones it has no sample for with a call on a minimal input whose output
contributes exactly zero to the loss: same collectives everywhere, gradients
unchanged.

The group ``(j, j)`` is always called, for every encoder: every encoder then
runs forward and backward in every microbatch, including the last, where
FSDP2 and Megatron-Core reduce gradients (a module whose backward did not run
there would miss the reduction), and no dummy parameter touch is needed.

The loader service computes this from the assignment and sends it in
``mb.meta[ENCODER_CALLS_KEY]``; the adapters fall back to one small max
all-reduce over the data-parallel group when the key is absent.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .assignment import Assignment
from .errors import InvalidInput

__all__ = ["ENCODER_CALLS_KEY", "encoder_calls", "calls_from_groups"]

ENCODER_CALLS_KEY = "encoder_calls"
"""``mb.meta`` key: ``{encoder name: [consumer microbatch c, ...]}`` sorted, every ``c >= j``
(microbatch ``j`` of every replica calls encoder ``name`` once per listed ``c``)."""


def calls_from_groups(groups: np.ndarray, names: list[str]) -> list[dict[str, list[int]]]:
    """Per microbatch j: ``{name: consumers}`` from a boolean ``[M, M, E]`` array whose
    ``[j, c, e]`` says some replica encodes in j, for consumer c, samples using encoder e;
    ``(j, j)`` is added for every encoder (see the module notes)."""
    m = groups.shape[0]
    if groups.shape != (m, m, len(names)):
        raise InvalidInput(
            f"encoder call groups: shape {groups.shape}, want ({m}, {m}, {len(names)})"
        )
    out = []
    for j in range(m):
        calls = {}
        for e, name in enumerate(names):
            consumers = set(np.flatnonzero(groups[j, :, e]).tolist()) | {j}
            if min(consumers) < j:
                raise InvalidInput(
                    f"encoder call groups: microbatch {j} encodes {name} for an earlier "
                    f"microbatch {min(consumers)}"
                )
            calls[name] = sorted(int(c) for c in consumers)
        out.append(calls)
    return out


def encoder_calls(
    assignment: Assignment, uses: Mapping[str, np.ndarray]
) -> list[dict[str, list[int]]]:
    """The group-wide encoder calls of every microbatch of one iteration (the same on every
    replica): the value of ``mb.meta[ENCODER_CALLS_KEY]`` for microbatch j is ``result[j]``.

    ``uses``: per encoder name (``"vision"``, ``"audio"``: the names the model's
    adapter knows), a boolean array over the global batch's samples, true when
    the sample has items for that encoder. Carried samples (not in this
    iteration's sets) are ignored.
    """
    m = assignment.microbatches
    names = list(uses)
    table = np.stack([np.asarray(uses[k], dtype=bool) for k in names], axis=1) if names else None
    groups = np.zeros((m, m, len(names)), dtype=bool)
    if table is None:
        return calls_from_groups(groups, names)
    n = table.shape[0]
    _, enc_mb = assignment.encoder_slots(n)
    _, llm_mb = assignment.llm_slots(n)
    live = (enc_mb >= 0) & (llm_mb >= 0)
    for e in range(len(names)):
        hit = live & table[:, e]
        groups[enc_mb[hit], llm_mb[hit], e] = True
    return calls_from_groups(groups, names)
