"""A worker process: takes fetch-decode-pack tasks from the coordinator, sends packed microbatches.

The worker owns nothing but its packer (open shards, the user's transform); its
sockets and packer are created inside the process (spawn start method), never
inherited. A task names table rows; the worker reads, decodes and packs them and
replies with a ``result`` envelope (a small header naming the task, then a
complete ``batch`` message the coordinator forwards to the ranks unchanged).

Sample errors follow the policy: ``raise`` reports ``failed`` (naming shard and
key) and the coordinator stops the epoch; ``skip`` packs the microbatch without
the bad samples and lists them in the result.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from entrain_data import protocol
from entrain_data.errors import EntrainError, SampleError

__all__ = [
    "Packed",
    "Packer",
    "IndexPackerFactory",
    "DatasetPackerFactory",
    "DatasetCosts",
    "WorkerPool",
    "run_worker",
    "stop_processes",
]

log = logging.getLogger(__name__)

_POLL_MS = 500


@dataclass
class Packed:
    """A packed microbatch as numpy arrays (named as in :mod:`entrain_data.batch`)."""

    encoder_keys: list[str]
    llm_keys: list[str]
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {key, source, error}


class Packer(Protocol):
    """Builds one microbatch from table rows (encoder set, LLM set), inside a worker."""

    def __call__(self, encoder_rows: list[int], llm_rows: list[int]) -> Packed: ...


@dataclass(frozen=True)
class IndexPackerFactory:
    """Picklable recipe for the default packer: read the index's samples, decode, pack.

    Called inside the worker process, so open files and decoders are the worker's
    own. ``transform`` (optional, picklable) is applied to every decoded sample.
    """

    index_path: str
    on_error: str = "raise"
    transform: Callable[[Any], Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> Packer:
        from . import packing  # H5's module: sources + decode + pack

        return packing.make_packer(
            self.index_path, on_error=self.on_error, transform=self.transform, **self.options
        )


def run_worker(
    index: int, generation: int, endpoint: str, factory: Callable[[], Packer], log_level: int
) -> None:
    """Process entry point: connect to the coordinator, serve tasks until ``stop`` or it is gone."""
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
        packer = factory()
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
    except SampleError as exc:
        return protocol.encode(
            "failed", {**ident, "error": str(exc), "source": exc.source, "key": exc.key}
        )
    except Exception as exc:  # any other bug in decode/transform: report it, do not die silently
        log.exception("task %s failed", ident)
        return protocol.encode(
            "failed",
            {**ident, "error": f"{type(exc).__name__}: {exc}", "source": None, "key": None},
        )
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


@dataclass
class _Slot:
    index: int
    generation: int
    process: Any
    ready: bool = False
    outstanding: set[int] = field(default_factory=set)
    tasks: int = 0
    samples: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def ident(self) -> bytes:
        return f"w{self.index}.{self.generation}".encode()


class WorkerPool:
    """The coordinator's view of its worker processes: spawn, track, restart, stop.

    Tasks are routed by worker identity (``w<index>.<generation>``); a restarted
    worker gets a new generation, so a late result from its predecessor is
    recognised and dropped.
    """

    def __init__(self, cfg: Any, back: zmq.Socket) -> None:
        self.cfg = cfg
        self.back = back
        self.ctx = mp.get_context("spawn")
        self.slots: list[_Slot] = []
        self.restarts = 0

    def _spawn(self, index: int, generation: int) -> _Slot:
        p = self.ctx.Process(
            target=run_worker,
            args=(
                index,
                generation,
                self.cfg.worker_endpoint,
                self.cfg.packer_factory,
                self.cfg.log_level,
            ),
            name=f"entrain-worker-{index}",
            daemon=True,
        )
        p.start()
        return _Slot(index, generation, p)

    def start(self) -> None:
        self.slots = [self._spawn(i, 0) for i in range(self.cfg.workers)]

    def _slot(self, ident: bytes) -> _Slot | None:
        for s in self.slots:
            if s.ident == ident:
                return s
        return None

    def mark_ready(self, ident: bytes) -> None:
        s = self._slot(ident)
        if s is not None:
            s.ready = True

    def idle_worker(self, capacity: int) -> _Slot | None:
        best = None
        for s in self.slots:
            if (
                s.ready
                and len(s.outstanding) < capacity
                and (best is None or len(s.outstanding) < len(best.outstanding))
            ):
                best = s
        return best

    def send(self, slot: _Slot, task_id: int, frames: list[Any]) -> None:
        self.back.send_multipart([slot.ident, *frames], copy=False)
        slot.outstanding.add(task_id)

    def task_done(self, ident: bytes, task_id: Any) -> None:
        s = self._slot(ident)
        if s is not None:
            s.outstanding.discard(task_id)
            s.tasks += 1

    def account(self, ident: bytes, nbytes: int, samples: int) -> None:
        s = self._slot(ident)
        if s is not None:
            s.bytes += nbytes
            s.samples += samples

    def reap(self) -> list[int]:
        """Restart every dead worker; returns the task ids it held (to re-issue)."""
        lost: list[int] = []
        for i, s in enumerate(self.slots):
            if s.process.is_alive():
                continue
            log.error(
                "worker %d (pid %s) exited with code %s holding %d task(s); restarting",
                s.index,
                s.process.pid,
                s.process.exitcode,
                len(s.outstanding),
            )
            lost.extend(sorted(s.outstanding))
            self.restarts += 1
            self.slots[i] = self._spawn(s.index, s.generation + 1)
        return lost

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for s in self.slots:
            up = max(time.monotonic() - s.started, 1e-9)
            out.append(
                {
                    "worker": s.index,
                    "pid": s.process.pid,
                    "generation": s.generation,
                    "tasks": s.tasks,
                    "samples": s.samples,
                    "bytes": s.bytes,
                    "samples_per_s": round(s.samples / up, 2),
                    "outstanding": len(s.outstanding),
                }
            )
        return out

    def stop(self, timeout: float = 5.0) -> None:
        """Ask every worker to stop, then escalate: join -> terminate -> kill."""
        for s in self.slots:
            if s.process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    self.back.send_multipart([s.ident, *protocol.encode("stop")], zmq.NOBLOCK)
        stop_processes([s.process for s in self.slots], timeout)


def stop_processes(procs: list[Any], timeout: float) -> None:
    """Join, then terminate, then kill whatever is still alive; never waits without a bound."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            log.warning("process %s (pid %s) did not stop; terminating", p.name, p.pid)
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            log.error("process %s (pid %s) ignored SIGTERM; killing", p.name, p.pid)
            p.kill()
            p.join(1.0)


@dataclass(frozen=True)
class DatasetPackerFactory:
    """Picklable recipe for running a user's torch ``Dataset`` inside the worker pool.

    Rows are dataset indices, keys their ``str``. The LLM set is collated with
    ``collate_fn`` (default: torch's ``default_collate``) and must give a dict of
    tensors/arrays; when the encoder set differs (deferral), its collated tensors
    follow under ``encoder/<name>``. The dataset must be picklable (spawn).
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None = None

    def __call__(self) -> Packer:
        return _DatasetPacker(self.dataset, self.collate_fn)


class _DatasetPacker:
    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        self.dataset, self.collate = dataset, collate_fn

    def _collate(self, rows: list[int], prefix: str) -> dict[str, np.ndarray]:
        if not rows:
            return {}
        batch = self.collate([self.dataset[i] for i in rows])
        if not isinstance(batch, dict):
            raise TypeError(f"collate_fn must return a dict of tensors, got {type(batch).__name__}")
        out = {}
        for name, value in batch.items():
            arr = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            out[prefix + str(name)] = arr
        return out

    def __call__(self, encoder_rows: list[int], llm_rows: list[int]) -> Packed:
        tensors = self._collate(llm_rows, "")
        if sorted(encoder_rows) != sorted(llm_rows):
            tensors.update(self._collate(encoder_rows, "encoder/"))
        return Packed([str(i) for i in encoder_rows], [str(i) for i in llm_rows], tensors)


@dataclass(frozen=True)
class DatasetCosts:
    """Picklable: per-sample costs of a wrapped dataset from the user's ``cost_fn(index)``.

    ``cost_fn(i)`` returns ``(encoder_cost, llm_cost, tokens)`` for sample ``i``
    from cheap metadata (it is called for every index once, in the coordinator).
    """

    length: int
    cost_fn: Callable[[int], tuple[float, float, int]]

    def __call__(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        vals = np.array([self.cost_fn(i) for i in range(self.length)], dtype=np.float64)
        if vals.ndim != 2 or vals.shape[1] != 3:
            raise TypeError("cost_fn(i) must return (encoder_cost, llm_cost, tokens)")
        return vals[:, :1], vals[:, 1], vals[:, 2].astype(np.int64)
