"""What each rank is sent of a microbatch, and a worker's direct route to the ranks that need it.

:func:`unread_features` is the one rule for which encoder inputs a rank's pipeline
stage never reads; both routes apply it. The direct route (:class:`Deliverer`)
leaves them out when it encodes; the coordinator's relay (hop ranks, and payloads a
remote worker brought back) drops their frames from the message it forwards with
:func:`without_unread`, the kept frames passed on untouched.

The task names each destination rank with its data socket and the encoder inputs
its pipeline stage does not read. The first pipeline stage (or any stage
holding an encoder) gets the whole microbatch; a stage that holds only LLM layers
gets it without the encoder feature tensors (pixels, video pixels, audio
features), which are nearly all of its bytes and which that stage never reads; a
stage holding only one kind of encoder gets it without the other kind's.
The frames of each variant are encoded once. Ranks on this host (ipc) get it
through the worker's shared-memory segments when the service has a directory
for them: written once for all of them, each rank sent only the header naming
the segment (:mod:`entrain_data.shared_batch`); with no free segment, and for
ranks on other hosts (tcp), the bytes go zero-copy over the socket.

One PUSH socket per destination, kept while it is in use (a bounded cache: ranks
that reconnect get new sockets). A send that cannot be queued at once (the rank
is gone and its queue is full) is not retried here: the rank is left out of the
``reached`` list and the coordinator, which knows whether the rank is still
connected, asks again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import msgpack
import zmq

from entrain_data import protocol
from entrain_data.shared_batch import SegmentPool
from entrain_data.tcp import family_for

__all__ = ["FEATURE_TENSORS", "Deliverer", "unread_features", "without_unread"]

log = logging.getLogger(__name__)

FEATURE_TENSORS = frozenset({"pixel_values", "pixel_values_videos", "audio_features"})
"""Encoder inputs a stage without encoder layers never reads (``entrain_data.batch`` names)."""
_READS = {"vision": {"pixel_values", "pixel_values_videos"}, "audio": {"audio_features"}}
"""The feature tensors an encoder of each kind reads."""


def unread_features(plan: Any, stage: Any) -> tuple[str, ...]:
    """The feature tensors ``stage`` of ``plan`` never reads: all of them on a stage without
    encoder layers, the other kind's on a stage holding only vision or only audio layers
    (Qwen2.5-VL's vision stage has no use for Whisper's mel frames, Whisper's stage none for
    the pixels, which are most of the bytes); none with one stage, or where the plan saved no
    model to tell the encoders' kinds."""
    encoders = {seg.encoder_index for seg in stage.segments if seg.kind == "encoder"}
    if plan.pp == 1:
        return ()
    if not encoders:
        return tuple(sorted(FEATURE_TENSORS))
    if not plan.model:
        return ()
    spec = plan.model_spec().encoders
    read = set().union(*(_READS.get(spec[e].kind, FEATURE_TENSORS) for e in encoders))
    return tuple(sorted(FEATURE_TENSORS - read))


def without_unread(frames: list[Any], unread: Collection[str]) -> list[Any]:
    """The ``batch`` message ``frames`` without the tensors named in ``unread``.

    A frame-level drop: the header is re-listed without their specs and their frames left
    out; every kept frame is the same object (no payload byte decoded or copied), so the
    coordinator relays a rank what the direct route would have sent it. ``frames`` must
    have passed :func:`entrain_data.protocol.decode` (the coordinator checks each payload
    as it lands); returned as is when nothing in it is unread.
    """
    if not unread:
        return frames
    header = protocol.decode_header(frames[0])
    specs = header["tensors"]
    keep = [i for i, spec in enumerate(specs) if spec[0] not in unread]
    if len(keep) == len(specs):
        return frames
    header["tensors"] = [specs[i] for i in keep]
    return [msgpack.packb(header, use_bin_type=True), *(frames[1 + i] for i in keep)]


_MAX_SOCKETS = 64
_SNDHWM = 64  # messages queued per rank; a rank's window is far smaller


class Deliverer:
    """The worker's sockets to ranks; :meth:`send` returns the ranks reached and bytes sent."""

    def __init__(self, ctx: zmq.Context, owner: str = "w") -> None:
        self.ctx, self.owner = ctx, owner
        self.socks: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.pool: SegmentPool | None = None

    def _pool(self, shared: str | None) -> SegmentPool | None:
        if shared is None:
            return None
        if self.pool is None or self.pool.root != shared:
            if self.pool is not None:
                self.pool.close()
            try:
                self.pool = SegmentPool(shared, self.owner)
            except OSError as exc:  # the directory is gone: the socket still works
                log.warning("no shared memory at %s: %s", shared, exc)
                return None
        return self.pool

    def _sock(self, endpoint: str, server_key: str | None = None) -> zmq.Socket:
        sock = self.socks.pop(endpoint, None)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            if server_key is not None:  # a rank's tcp socket: CURVE with the rank's key
                pub, sec = zmq.curve_keypair()
                sock.curve_serverkey = server_key.encode("ascii")
                sock.curve_publickey, sock.curve_secretkey = pub, sec
            family_for(sock, endpoint)
            sock.connect(endpoint)
        self.socks[endpoint] = sock  # most recently used last
        while len(self.socks) > _MAX_SOCKETS:
            _, old = self.socks.popitem(last=False)
            old.close(linger=0)
        return sock

    def send(
        self,
        dests: list[Any],
        fields: dict[str, Any],
        tensors: dict[str, Any],
        *,
        shared: str | None = None,
    ) -> tuple[list[int], int, int]:
        """Send the ``batch`` message to every ``[rank, endpoint, unread(, curve key)]``
        (``unread``: the feature tensors its stage never reads, :func:`unread_features`).

        ``shared``: the service's shared-memory directory, for ranks on this host.
        Returns the ranks reached, the bytes they received (each its own) and the bytes
        written into shared memory (once for all that read them).
        """
        groups: dict[tuple[tuple[str, ...], bool], list[Any]] = {}
        for dest in dests:  # by variant, and by whether the rank is on this host
            groups.setdefault((tuple(dest[2]), len(dest) > 3), []).append(dest)
        reached: list[int] = []
        sent = written = 0
        for (unread, remote), group in groups.items():
            kept = {k: v for k, v in tensors.items() if k not in unread}
            frames = protocol.encode("batch", fields, kept)
            pool = None if remote else self._pool(shared)
            slot = pool.write(frames[1:], [d[1] for d in group]) if pool is not None else None
            size = sum(len(f) for f in frames[1:])  # uint8 views: len is bytes
            written += size if slot is not None else 0
            for reader, (rank, endpoint, _, *key) in enumerate(group):
                if slot is not None:
                    shm = {**slot, "reader": reader}
                    frames = protocol.encode("batch", {**fields, "shm": shm}, kept)[:1]
                try:
                    sock = self._sock(endpoint, key[0] if key else None)
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.ZMQError as exc:  # Again (queue full) or a bad endpoint
                    log.warning("rank %s at %s not reached: %s", rank, endpoint, exc)
                    if slot is not None:
                        pool.release(slot, reader)
                    continue
                reached.append(int(rank))
                sent += size
        return reached, sent, written

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        for sock in self.socks.values():
            sock.close()  # linger: what was queued still leaves
        self.socks.clear()
