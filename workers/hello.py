"""A rank's ``hello``, checked: a pure function from the header to (rank, start position).

Kept apart from the coordinator's loop so every refusal (a rank this service does
not serve, resume state for another plan or seed, a position outside the stream)
is one testable rule with one message that names the field at fault.
"""

from __future__ import annotations

from typing import Any

from entrain_data.errors import InvalidInput, ProtocolError

from .schedule import StreamShape

__all__ = ["check_hello", "past_end"]


def check_hello(
    h: dict[str, Any],
    *,
    ranks: range,
    fingerprint: str,
    data_fingerprint: str,
    seed: int,
    shape: StreamShape,
) -> tuple[int, tuple[int, int, int], bool]:
    """The rank, start position (epoch, iteration, microbatch) and elasticity of a ``hello``.

    Resume state names a position in the epoch's sample order. Under the same service
    fingerprint (plan, seed, data) it resumes exactly; under another plan over the same
    data (seed, index content, global batch: ``data_fingerprint``) it resumes
    *elastically*, at the start of its iteration, which the new plan re-assigns (the
    third value is then true). Raises :class:`ProtocolError` for a malformed header,
    :class:`InvalidInput` for resume state that does not belong to this service.
    """
    rank = h.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank not in ranks:
        raise ProtocolError(
            f"rank {rank!r} is not served here (this service serves ranks "
            f"{ranks.start}..{ranks.stop - 1})"
        )
    want, want_data = h.get("fingerprint"), h.get("data_fingerprint")
    elastic = want is not None and want != fingerprint
    if elastic and want_data != data_fingerprint:
        raise InvalidInput(
            f"rank {rank}: resume state is for service {want} (data {want_data}), this "
            f"service serves {fingerprint} (data {data_fingerprint}): another seed, index "
            "or global batch"
        )
    if h.get("seed") is not None and h.get("seed") != seed:
        raise InvalidInput(
            f"rank {rank}: resume state has seed {h.get('seed')}, service seed is {seed}"
        )
    pos = h.get("position") or [0, 0, 0]
    try:
        epoch, it, mb = (int(x) for x in pos)
    except (TypeError, ValueError):
        raise ProtocolError(f"rank {rank}: bad start position {pos!r}") from None
    if not (0 <= it < shape.iterations and 0 <= mb < shape.microbatches and epoch >= 0):
        raise ProtocolError(f"rank {rank}: start position {pos!r} outside the stream")
    if elastic:
        mb = 0  # a new plan re-assigns the whole iteration: resume at its start
    return rank, (epoch, it, mb), elastic


def past_end(position: Any, epochs: int) -> bool:
    """Whether a ``bye``'s ``next`` (the microbatch the rank would read next) lies past the
    rank's last microbatch: it read them all. Anything malformed reads as not past."""
    if not (isinstance(position, list) and len(position) == 3):
        return False
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in position):
        return False
    epoch, it, mb = position
    return epoch >= epochs and it == 0 and mb == 0
