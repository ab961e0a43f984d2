"""A worker process: takes fetch-decode-pack tasks from the coordinator, sends packed microbatches.

The pool that starts these processes is :mod:`.pool`; what they pack comes from a
:mod:`.sample_source` (``Packed`` is re-exported here for older imports).

The worker owns nothing but its packer (open shards, the user's transform); its
sockets and packer are created inside the process (spawn start method), never
inherited. A task names table rows; the worker reads, decodes and packs them and
sends it straight to the ranks the task names (:mod:`.delivery`), then replies
with a ``result`` envelope: a small header naming the task and the ranks reached,
followed by the complete ``batch`` message only when the coordinator asked for the
payload (ranks it serves itself; a remote worker always returns it).

Sample errors follow the policy: ``raise`` reports ``failed`` with the error's
type and fields (a ``SampleError`` names shard and key) and the coordinator stops;
``skip`` packs the microbatch without the bad samples and lists them in the result.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from entrain_data import protocol
from entrain_data.encoder_calls import ENCODER_CALLS_KEY
from entrain_data.errors import (
    EntrainError,
    InvalidInput,
    ProtocolError,
    WorkerDied,
    error_fields,
    error_from_fields,
)
from entrain_data.tcp import HandshakeWatch, family_for

from .delivery import Deliverer
from .sample_source import WIRE_NOTE, Packed, Packer, SampleSource, describe, wire_array

__all__ = ["Packed", "run_worker", "run_remote_worker"]

log = logging.getLogger(__name__)

_POLL_MS = 500
SILENCE_S = 60.0
"""A remote worker idle this long with no word from its service (which answers every heartbeat
and says how long to wait: twice its own wait for a silent worker) stops with an error: the
service died. The rule starts with the first answer, so a worker may start before its service
(a key the service refuses is told at once by the handshake watch)."""


def run_worker(
    index: int, generation: int, endpoint: str, source: SampleSource, log_level: int
) -> None:
    """Process entry point: connect to the coordinator, serve tasks until ``stop`` or it is gone.

    SIGINT is ignored (the coordinator stops its workers); a packer that cannot be
    built is reported as ``failed`` with no task, so the coordinator stops at once.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{index}.{generation}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    sock.connect(endpoint)
    deliverer = Deliverer(ctx, owner=f"w{index}.{generation}")  # names its shared segments
    try:
        _serve_tasks(
            sock, source, f"worker {index}", _parent_gone_check(), heartbeat=False, out=deliverer
        )
    finally:
        deliverer.close()
        sock.close(linger=0)
        ctx.term()


def run_remote_worker(
    endpoint: str,
    source: SampleSource,
    *,
    curve_server_key: bytes | None = None,
    name: str | None = None,
) -> None:
    """A worker on another host (``entrain-data worker --connect``): joins a service over tcp.

    It says ``ready`` with its source's identity (the service refuses a worker that
    would pack another index, with an ``error`` this raises), then sends a heartbeat
    whenever it is idle, so the service can tell a dead remote worker from a busy one and
    re-issue its tasks; the service answers each, and :data:`SILENCE_S` without a word
    raises :class:`WorkerDied` (the service is gone, or unreachable with this key). CURVE
    encrypts and authenticates the connection when the service's key is given.
    """
    ident = (name or f"x{socket.gethostname()}-{os.getpid()}").encode()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    family_for(sock, endpoint)
    watch = None  # a key the service refuses is told at once, not waited out
    if curve_server_key is not None:
        pub, sec = zmq.curve_keypair()
        sock.curve_serverkey = curve_server_key
        sock.curve_publickey, sock.curve_secretkey = pub, sec
        watch = HandshakeWatch(sock)
    sock.connect(endpoint)
    deadline: list[float] = [0.0]

    def gone() -> bool:  # a result that cannot leave in 10 s is dropped (the task is re-issued)
        if deadline[0] == 0.0:
            deadline[0] = time.monotonic() + 10.0
        if time.monotonic() > deadline[0]:
            deadline[0] = 0.0
            return True
        return False

    deliverer = Deliverer(ctx)  # to ranks' tcp sockets (CURVE), when the task names them
    try:
        _serve_tasks(sock, source, ident.decode(), gone, heartbeat=True, out=deliverer, watch=watch)
    finally:
        deliverer.close()
        if watch is not None:
            watch.close()
        sock.close(linger=0)
        ctx.term()


def _serve_tasks(
    sock: zmq.Socket,
    source: SampleSource,
    label: str,
    gone: Callable[[], bool],
    *,
    heartbeat: bool,
    out: Deliverer | None = None,
    watch: HandshakeWatch | None = None,
) -> None:
    """Build the packer, say ready, then pack every task until ``stop`` (or the service is gone)."""
    try:
        packer = source.make_packer()
    except Exception as exc:  # a configuration error: every worker would fail the same way
        err = exc if isinstance(exc, EntrainError) else InvalidInput(f"packer: {exc}")
        _send(sock, protocol.encode("failed", {"task": None, **error_fields(err)}), gone)
        return
    # a remote worker proves it packs the same samples (local ones share the source object)
    identity = getattr(source, "identity", lambda: None)() if heartbeat else None
    ready = {"pid": os.getpid(), "source": identity, "remote": heartbeat}
    sock.send_multipart(protocol.encode("ready", ready))
    if heartbeat:  # asks the silence rule now: a worker busy from its first task still learns it
        _send(sock, protocol.encode("heartbeat", {}), gone)
    heard, silence = time.monotonic(), None  # no rule before the first answer (a slow start)
    while True:
        if not sock.poll(_POLL_MS):
            if watch is not None and watch.refused():
                raise InvalidInput(
                    f"{label}: the loader service refused the encryption handshake: "
                    "is --curve-server-key its public key?"
                )
            if heartbeat and silence is not None and time.monotonic() - heard > silence:
                raise WorkerDied(
                    f"{label}: no word from the service for {silence:.0f}s: it stopped, or "
                    "is unreachable from here (address, firewall, --curve-server-key)"
                )
            if heartbeat:
                _send(sock, protocol.encode("heartbeat", {}), gone)
            elif gone():  # coordinator gone: do not linger as an orphan
                log.warning("%s: coordinator gone, exiting", label)
                return
            continue
        frames = sock.recv_multipart(copy=False)
        try:
            msg = protocol.decode(frames)
        except EntrainError as exc:
            log.error("%s: dropped a malformed message: %s", label, exc)
            continue
        heard = time.monotonic()
        if msg.kind == "stop":
            return
        if msg.kind == "heartbeat":
            silence = _positive(msg.header.get("silence"), SILENCE_S)
            continue
        if msg.kind == "error":  # refused (another index): say why, do not exit as if done
            raise error_from_fields(msg.header, prefix=f"{label}: the service refused it: ")
        if msg.kind != "task":
            log.error("%s: unexpected %r message", label, msg.kind)
            continue
        if not _send(sock, _run_task(packer, msg.header, out), gone) and not heartbeat:
            log.warning("%s: coordinator gone, exiting", label)
            return
        heard = time.monotonic()  # a long task is no silence: the clock runs while idle
        if silence is None:  # a service that sent work is up: its rule, or the default
            silence = SILENCE_S


def _positive(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and value > 0 else default


def _parent_gone_check() -> Callable[[], bool]:
    """A check that the coordinator process has gone. Uses the spawn sentinel pipe, so it also
    holds when the coordinator died before this process started (its ppid is then already 1)."""
    proc = mp.parent_process()
    if proc is not None:
        return lambda: not proc.is_alive()
    first = os.getppid()
    return lambda: os.getppid() != first or first == 1


def _send(sock: zmq.Socket, frames: list[Any], parent: Callable[[], bool]) -> bool:
    """Send, waiting at most a second at a time: a DEALER with no peer blocks forever otherwise."""
    while True:
        try:
            sock.send_multipart(frames, copy=False)
            return True
        except zmq.Again:
            if parent():
                return False


def _run_task(packer: Packer, task: dict[str, Any], out: Deliverer | None) -> list[Any]:
    """Pack one task, deliver it to the ranks it names, return the coordinator's reply."""
    ident = {k: task[k] for k in ("task", "epoch", "iteration", "microbatch", "replica")}
    try:
        packed = packer(list(task["encoder_rows"]), list(task["llm_rows"]))
    except EntrainError as exc:  # typed (SampleError names shard and key): crosses as such
        return protocol.encode("failed", {**ident, **error_fields(exc)})
    except Exception as exc:  # any other bug in decode/transform: report it, do not die silently
        log.exception("task %s failed", ident)
        return protocol.encode("failed", {**ident, **error_fields(exc)})
    fields = {
        "epoch": ident["epoch"],
        "iteration": ident["iteration"],
        "microbatch": ident["microbatch"],
        "replica": ident["replica"],
        "encoder_keys": packed.encoder_keys,
        "llm_keys": packed.llm_keys,
        "meta": packed.meta,
    }
    if task.get("encoder_calls") is not None:  # group-wide calls for sharded data parallelism
        fields["meta"] = {**packed.meta, ENCODER_CALLS_KEY: task["encoder_calls"]}
    dests = task.get("deliver") or []
    reached: list[int] = []
    sent = shared_bytes = 0
    # a packer's tensor the wire cannot carry is that task's error, not this worker's death
    unsendable = [n for n, v in packed.tensors.items() if wire_array(v) is None]
    if unsendable:
        value = packed.tensors[unsendable[0]]
        exc = ProtocolError(
            f"tensor {unsendable[0]!r}: {describe(value)} is not allowed on the wire ({WIRE_NOTE})"
        )
        log.error("task %s: %s", ident, exc)
        return protocol.encode("failed", {**ident, **error_fields(exc)})
    if out is not None and dests:
        shared = task.get("shared")
        shared = shared if isinstance(shared, str) else None
        reached, sent, shared_bytes = out.send(dests, fields, packed.tensors, shared=shared)
    summary = {
        **ident,
        "skipped": packed.skipped,
        "reached": reached,
        "sent_bytes": sent,
        "shared_bytes": shared_bytes,
        "samples": len(packed.llm_keys),
        "nbytes": int(sum(v.nbytes for v in packed.tensors.values())),
    }
    envelope = protocol.encode("result", summary)
    if not task.get("payload", True) and out is not None:
        return envelope
    return envelope + protocol.encode("batch", fields, packed.tensors)
