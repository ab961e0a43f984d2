"""A worker's direct route: send a packed microbatch straight to the ranks that need it.

The task names each destination rank with its ipc data socket and whether its
pipeline stage reads the encoder inputs. The first pipeline stage (or any stage
holding an encoder) gets the whole microbatch; a stage that holds only LLM layers
gets it without the encoder feature tensors (pixels, video pixels, audio
features), which are nearly all of its bytes and which that stage never reads.
The frames of each variant are encoded once and sent zero-copy to every rank
that takes it; where several ranks take the same variant (tensor-parallel peers)
and the service has a shared-memory directory, the tensors are written once into
a file there and each peer gets only the header naming it
(:mod:`entrain_data.shared_batch`).

One PUSH socket per destination, kept while it is in use (a bounded cache: ranks
that reconnect get new sockets). A send that cannot be queued at once (the rank
is gone and its queue is full) is not retried here: the rank is left out of the
``reached`` list and the coordinator, which knows whether the rank is still
connected, asks again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import zmq

from entrain_data import protocol
from entrain_data.shared_batch import write_shared

__all__ = ["FEATURE_TENSORS", "Deliverer"]

log = logging.getLogger(__name__)

FEATURE_TENSORS = frozenset({"pixel_values", "pixel_values_videos", "audio_features"})
"""Encoder inputs a stage without encoder layers never reads (``entrain_data.batch`` names)."""

_MAX_SOCKETS = 64
_SNDHWM = 64  # messages queued per rank; a rank's window is far smaller


class Deliverer:
    """The worker's sockets to ranks; :meth:`send` returns the ranks reached and bytes sent."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.socks: OrderedDict[str, zmq.Socket] = OrderedDict()

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
    ) -> tuple[list[int], int, list[str]]:
        """Send the ``batch`` message to every ``[rank, endpoint, features(, curve key)]``.

        ``shared``: a file path prefix in shared memory, used for a variant two or more
        ranks take. Returns the ranks reached, the bytes sent over ipc and the files written.
        """
        groups: dict[bool, list[Any]] = {}
        for dest in dests:
            groups.setdefault(bool(dest[2]), []).append(dest)
        reached: list[int] = []
        sent = 0
        files: list[str] = []
        for features, group in groups.items():
            kept = tensors if features else _without_features(tensors)
            frames = protocol.encode("batch", fields, kept)
            if shared is not None and len(group) > 1:
                path = f"{shared}-{int(features)}.mb"
                offsets = write_shared(path, frames[1:])
                files.append(path)
                shm = {"path": path, "offsets": offsets}  # the header keeps the tensors' specs
                frames = protocol.encode("batch", {**fields, "shm": shm}, kept)[:1]
            for rank, endpoint, _, *key in group:
                try:
                    sock = self._sock(endpoint, key[0] if key else None)
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.ZMQError as exc:  # Again (queue full) or a bad endpoint
                    log.warning("rank %s at %s not reached: %s", rank, endpoint, exc)
                    continue
                reached.append(int(rank))
                sent += sum(len(f) for f in frames[1:])  # uint8 views: len is bytes
        return reached, sent, files

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()  # linger: what was queued still leaves
        self.socks.clear()


def _without_features(tensors: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tensors.items() if k not in FEATURE_TENSORS}
