"""The wire format between loader service, workers and clients: pure functions over bytes.

A message is a ZeroMQ multipart message: frame 0 is a msgpack header, frames
1..n are the raw buffers of the tensors the header lists, in order. Nothing is
ever unpickled: a header is a msgpack map of plain scalars, strings and lists,
and a buffer is only reinterpreted as the numeric dtype the header names, after
checking its byte size against the shape. Every check failure raises
:class:`~entrain_data.errors.ProtocolError`, so a peer that sends garbage is
rejected, logged, and the receiver goes on serving everyone else.

Header fields common to every message: ``v`` (:data:`PROTOCOL_VERSION`),
``kind`` (one of :data:`KINDS`) and ``tensors`` (a list of ``[name, dtype,
shape, nbytes]``). Everything else is the kind's own payload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "KINDS",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "TensorSpec",
    "Message",
    "encode",
    "decode",
    "decode_header",
]

PROTOCOL_VERSION = 2  # 2: a task's deliver entries list the tensors a stage does not read
"""Bumped on any incompatible change of the header or the framing."""

KINDS = frozenset(
    {
        # client <-> coordinator
        "hello",  # client -> service: rank, protocol version, start position
        "welcome",  # service -> client: plan, replica, seed, epochs
        "credit",  # client -> service: may send n more microbatches
        "batch",  # service -> client: one microbatch (tensors follow)
        "end",  # service -> client: the epoch is over
        "error",  # either way: a fatal error with a message
        "stats",  # client -> service request / service -> client counters
        "bye",  # client -> service: closing
        # coordinator <-> worker
        "ready",  # worker -> coordinator: started, can take tasks
        "heartbeat",  # remote worker -> coordinator: idle but alive
        "task",  # coordinator -> worker: fetch, decode and pack one microbatch
        "result",  # worker -> coordinator: a packed microbatch (tensors follow)
        "failed",  # worker -> coordinator: the task failed (sample error)
        "stop",  # coordinator -> worker: exit
    }
)

DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
)
"""Tensor dtypes allowed on the wire (numpy names); anything else is rejected."""

MAX_HEADER_BYTES = 64 * 1024 * 1024
"""Headers carry key lists, never payloads; a larger one is garbage or an attack."""

_MAX_DIMS = 8


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one buffer frame; ``nbytes`` is checked against the frame."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Message:
    """A decoded message: the header fields, the tensor specs, and the raw buffers.

    ``buffers[i]`` is the frame of ``specs[i]`` as the receiver got it (bytes,
    a memoryview or a ``zmq.Frame``'s buffer), untouched: the client wraps it
    with ``torch.frombuffer`` so the payload is never copied.
    """

    kind: str
    header: dict[str, Any]
    specs: tuple[TensorSpec, ...] = ()
    buffers: tuple[Any, ...] = field(default=(), repr=False)

    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors as numpy arrays viewing the buffers (read-only, no copy)."""
        out: dict[str, np.ndarray] = {}
        for spec, buf in zip(self.specs, self.buffers):
            arr = np.frombuffer(buf, dtype=np.dtype(spec.dtype)) if spec.nbytes else None
            if arr is None:
                arr = np.zeros(0, dtype=np.dtype(spec.dtype))
            out[spec.name] = arr.reshape(spec.shape)
        return out


def encode(
    kind: str,
    fields: Mapping[str, Any] | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
) -> list[Any]:
    """Frames of one message: ``[header, buffer...]``; buffers are the arrays' memory (no copy).

    Non-contiguous arrays are made contiguous (one copy); arrays whose dtype is not
    in :data:`DTYPES` raise :class:`ProtocolError`.
    """
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    fields = dict(fields or {})
    for reserved in ("v", "kind", "tensors"):
        if reserved in fields:
            raise ProtocolError(f"header field {reserved!r} is reserved")
    specs: list[list[Any]] = []
    buffers: list[Any] = []
    for name, value in (tensors or {}).items():
        arr = np.ascontiguousarray(value)
        dt = arr.dtype.name
        if dt not in DTYPES or arr.dtype.byteorder == ">":
            raise ProtocolError(f"tensor {name!r}: dtype {arr.dtype} is not allowed on the wire")
        specs.append([str(name), dt, list(arr.shape), int(arr.nbytes)])
        buffers.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.nbytes else b"")
    header = {"v": PROTOCOL_VERSION, "kind": kind, "tensors": specs, **fields}
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{kind} header is not msgpack-serialisable: {exc}") from exc
    return [packed, *buffers]


def decode_header(frame: Any) -> dict[str, Any]:
    """Parse and check frame 0: a msgpack map with our version and a known kind."""
    raw = _as_bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, expected a map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} does not match this side's {PROTOCOL_VERSION}"
        )
    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if not isinstance(header.get("tensors", []), list):
        raise ProtocolError("header field 'tensors' must be a list")
    return header


def decode(frames: Sequence[Any]) -> Message:
    """Check and decode a multipart message; raises :class:`ProtocolError` on any mismatch."""
    if len(frames) < 1:
        raise ProtocolError("empty message")
    header = decode_header(frames[0])
    raw_specs = header.pop("tensors", [])
    if len(raw_specs) != len(frames) - 1:
        raise ProtocolError(
            f"{header['kind']} header lists {len(raw_specs)} tensor(s) but "
            f"{len(frames) - 1} buffer frame(s) followed"
        )
    specs = tuple(_check_spec(s) for s in raw_specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ProtocolError(f"duplicate tensor names in {names}")
    buffers = []
    for spec, frame in zip(specs, frames[1:]):
        buf = _as_buffer(frame)
        size = buf.nbytes if isinstance(buf, memoryview) else len(buf)
        if size != spec.nbytes:
            raise ProtocolError(
                f"tensor {spec.name!r}: frame has {size} bytes, header says {spec.nbytes}"
            )
        buffers.append(buf)
    kind = header.pop("kind")
    header.pop("v")
    return Message(kind=kind, header=header, specs=specs, buffers=tuple(buffers))


def _check_spec(raw: Any) -> TensorSpec:
    if not (isinstance(raw, list) and len(raw) == 4):
        raise ProtocolError(f"tensor spec must be [name, dtype, shape, nbytes], got {raw!r:.80}")
    name, dtype, shape, nbytes = raw
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"tensor name must be a non-empty string, got {name!r:.80}")
    if dtype not in DTYPES:
        raise ProtocolError(f"tensor {name!r}: dtype {dtype!r:.40} is not allowed on the wire")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"tensor {name!r}: bad shape {shape!r:.80}")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ProtocolError(f"tensor {name!r}: bad byte size {nbytes!r:.40}")
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if expected != nbytes:
        raise ProtocolError(
            f"tensor {name!r}: shape {shape} of {dtype} is {expected} bytes, header says {nbytes}"
        )
    return TensorSpec(name, dtype, tuple(shape), nbytes)


def _as_buffer(frame: Any) -> Any:
    """The frame's memory without copying (``zmq.Frame`` exposes ``.buffer``)."""
    buf = getattr(frame, "buffer", None)
    if buf is not None:
        return buf
    if isinstance(frame, bytes | bytearray | memoryview):
        return frame
    raise ProtocolError(f"frame of type {type(frame).__name__} is not a buffer")


def _as_bytes(frame: Any) -> bytes:
    buf = _as_buffer(frame)
    return bytes(buf)
