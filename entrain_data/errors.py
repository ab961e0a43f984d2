"""One error hierarchy for the whole package.

Every error a user can meet derives from :class:`EntrainError`; bad input raises
:class:`InvalidInput` (also a ``ValueError``) whose message names the offending
file, column, key or field, so the CLI can print it as one line and exit 2.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EntrainError",
    "InvalidInput",
    "AddressInUse",
    "EntrainTimeout",
    "WorkerDied",
    "ProtocolError",
    "SampleError",
    "PlanError",
    "ServiceStopped",
    "error_fields",
    "error_from_fields",
]


class EntrainError(Exception):
    """Root of every error raised on purpose by entrain_data."""


class InvalidInput(EntrainError, ValueError):
    """Bad input: the message names the file, column, key or field at fault."""


class AddressInUse(InvalidInput):
    """An endpoint another process binds already; ``endpoint`` names it (``None`` once the
    error crossed the wire: the message names it too). Typed so that a service which picked
    the port itself can pick again without reading the message."""

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint


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


class ServiceStopped(EntrainError):
    """The loader service stopped (a signal, a failure) before this rank's stream ended."""


_WIRE_TYPES: dict[str, type[EntrainError]] = {
    cls.__name__: cls
    for cls in (
        EntrainError,
        InvalidInput,
        AddressInUse,
        PlanError,
        SampleError,
        EntrainTimeout,
        WorkerDied,
        ProtocolError,
        ServiceStopped,
    )
}


def error_fields(exc: BaseException) -> dict[str, Any]:
    """The header fields that carry ``exc`` across the wire: type name, message, sample fields.

    Only the names above cross: a subclass of one (a module's private ``InvalidInput``)
    crosses as the nearest of them, so ``except InvalidInput`` still catches it on the other
    side; anything else (a user's ``EntrainError`` subclass, a ``KeyError``) travels as a
    plain ``EntrainError`` whose message starts with its type. Nothing is unpickled on the
    other side.
    """
    wire = next((c for c in type(exc).__mro__ if _WIRE_TYPES.get(c.__name__) is c), EntrainError)
    name, message = wire.__name__, str(exc)
    if wire is EntrainError and type(exc) is not EntrainError:  # its own name says what it is
        message = f"{type(exc).__name__}: {exc}"
    return {
        "error_type": name,
        "message": message,
        "source": getattr(exc, "source", None),
        "key": getattr(exc, "key", None),
    }


def error_from_fields(fields: dict[str, Any], prefix: str = "") -> EntrainError:
    """Rebuild the typed error :func:`error_fields` described (unknown types: ``EntrainError``)."""
    cls = _WIRE_TYPES.get(str(fields.get("error_type")), EntrainError)
    message = f"{prefix}{fields.get('message', '?')}"
    if cls is SampleError:
        source, key = fields.get("source"), fields.get("key")
        return SampleError(
            message,
            source=source if isinstance(source, str) else None,
            key=key if isinstance(key, str) else None,
        )
    return cls(message)
