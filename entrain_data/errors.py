"""One error hierarchy for the whole package.

Every error a user can meet derives from :class:`EntrainError`; bad input raises
:class:`InvalidInput` (also a ``ValueError``) whose message names the offending
file, column, key or field, so the CLI can print it as one line and exit 2.
"""

from __future__ import annotations

__all__ = [
    "EntrainError",
    "InvalidInput",
    "EntrainTimeout",
    "WorkerDied",
    "ProtocolError",
    "SampleError",
    "PlanError",
]


class EntrainError(Exception):
    """Root of every error raised on purpose by entrain_data."""


class InvalidInput(EntrainError, ValueError):
    """Bad input: the message names the file, column, key or field at fault."""


class PlanError(InvalidInput):
    """No feasible parallel layout, or a plan that does not fit the cluster or model."""


class SampleError(EntrainError):
    """A sample could not be read or decoded; names the shard (or table) and key."""

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        super().__init__(message)
        self.source = source
        self.key = key


class EntrainTimeout(EntrainError, TimeoutError):
    """A wait expired; the message says what was waited for (iteration, microbatch, endpoint)."""


class WorkerDied(EntrainError):
    """A process we depend on exited unexpectedly."""


class ProtocolError(EntrainError):
    """A malformed message, foreign schema version or unknown peer on the wire."""
