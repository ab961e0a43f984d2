"""A worker process: takes fetch-decode-pack tasks from the coordinator, sends packed microbatches.

The pool that starts these processes is :mod:`.pool`; what they pack comes from a
:mod:`.sample_source` (``Packed`` is re-exported here for older imports).

The worker owns nothing but its packer (open shards, the user's transform); its
sockets and packer are created inside the process (spawn start method), never
inherited. A task names table rows; the worker reads, decodes and packs them and
replies with a ``result`` envelope (a small header naming the task, then a
complete ``batch`` message the coordinator forwards to the ranks unchanged).

Sample errors follow the policy: ``raise`` reports ``failed`` with the error's
type and fields (a ``SampleError`` names shard and key) and the coordinator stops;
``skip`` packs the microbatch without the bad samples and lists them in the result.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

import zmq

from entrain_data import protocol
from entrain_data.errors import EntrainError, InvalidInput, error_fields

from .sample_source import Packed, Packer, SampleSource

__all__ = ["Packed", "run_worker"]

log = logging.getLogger(__name__)

_POLL_MS = 500


def run_worker(
    index: int, generation: int, endpoint: str, source: SampleSource, log_level: int
) -> None:
    """Process entry point: connect to the coordinator, serve tasks until ``stop`` or it is gone.

    SIGINT is ignored (the coordinator stops its workers); a packer that cannot be
    built is reported as ``failed`` with no task, so the coordinator stops at once.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ident = f"w{index}.{generation}".encode()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    sock.connect(endpoint)
    parent = _parent_gone_check()
    try:
        try:
            packer = source.make_packer()
        except Exception as exc:  # a configuration error: every worker would fail the same way
            err = exc if isinstance(exc, EntrainError) else InvalidInput(f"packer: {exc}")
            _send(sock, protocol.encode("failed", {"task": None, **error_fields(err)}), parent)
            return
        sock.send_multipart(protocol.encode("ready", {"worker": index, "pid": os.getpid()}))
        while True:
            if not sock.poll(_POLL_MS):
                if parent():  # coordinator gone: do not linger as an orphan
                    log.warning("worker %d: coordinator gone, exiting", index)
                    return
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                msg = protocol.decode(frames)
            except EntrainError as exc:
                log.error("worker %d: dropped a malformed message: %s", index, exc)
                continue
            if msg.kind == "stop":
                return
            if msg.kind != "task":
                log.error("worker %d: unexpected %r message", index, msg.kind)
                continue
            if not _send(sock, _run_task(packer, msg.header), parent):
                log.warning("worker %d: coordinator gone, exiting", index)
                return
    finally:
        sock.close(linger=0)
        ctx.term()


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


def _run_task(packer: Packer, task: dict[str, Any]) -> list[Any]:
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
    envelope = protocol.encode("result", {**ident, "skipped": packed.skipped})
    return envelope + protocol.encode("batch", fields, packed.tensors)
