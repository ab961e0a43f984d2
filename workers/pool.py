"""The coordinator's worker processes: spawn, track, restart, stop.

Tasks are routed by worker identity (``w<index>.<generation>``); a restarted
worker gets a new generation, so a late result from its predecessor is
recognised and dropped. A worker that cannot start (its packer fails to build, or
it dies before saying ``ready`` twice in a row) is a configuration error, not a
reason to restart it forever: :attr:`WorkerPool.fatal` then holds the error.

Workers are spawned with SIGINT ignored: a Ctrl-C in a terminal reaches the whole
process group, and the coordinator alone decides how its workers stop.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from entrain_data import protocol
from entrain_data.errors import EntrainError, WorkerDied

from .sample_source import SampleSource
from .worker import run_worker

__all__ = ["WorkerPool", "stop_processes"]

log = logging.getLogger(__name__)

_START_FAILURES = 2  # consecutive deaths before "ready" that make a configuration error


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
    """``workers`` processes that connect to ``endpoint`` and pack with ``source``'s packer."""

    def __init__(
        self,
        back: zmq.Socket,
        *,
        endpoint: str,
        source: SampleSource,
        workers: int,
        log_level: int = logging.WARNING,
    ) -> None:
        self.back = back
        self.endpoint = endpoint
        self.source = source
        self.workers = workers
        self.log_level = log_level
        self.ctx = mp.get_context("spawn")
        self.slots: list[_Slot] = []
        self.restarts = 0
        self.fatal: EntrainError | None = None
        self._start_failures: dict[int, int] = {}

    def _spawn(self, index: int, generation: int) -> _Slot:
        p = self.ctx.Process(
            target=run_worker,
            args=(index, generation, self.endpoint, self.source, self.log_level),
            name=f"entrain-worker-{index}",
            daemon=True,
        )
        with _sigint_ignored():  # inherited through spawn's exec: the worker never sees Ctrl-C
            p.start()
        return _Slot(index, generation, p)

    def start(self) -> None:
        self.slots = [self._spawn(i, 0) for i in range(self.workers)]

    def _slot(self, ident: bytes) -> _Slot | None:
        for s in self.slots:
            if s.ident == ident:
                return s
        return None

    def mark_ready(self, ident: bytes) -> None:
        s = self._slot(ident)
        if s is not None:
            s.ready = True
            self._start_failures.pop(s.index, None)

    def start_failed(self, ident: bytes, error: EntrainError) -> None:
        """A worker could not build its packer: the same configuration fails in every worker."""
        if self._slot(ident) is not None and self.fatal is None:
            self.fatal = error

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
        """Restart every dead worker; returns the task ids it held (to re-issue).

        A worker that dies before ``ready`` twice in a row sets :attr:`fatal` instead.
        """
        lost: list[int] = []
        for i, s in enumerate(self.slots):
            if s.process.is_alive():
                continue
            if not s.ready:
                n = self._start_failures.get(s.index, 0) + 1
                self._start_failures[s.index] = n
                if n >= _START_FAILURES and self.fatal is None:
                    self.fatal = WorkerDied(
                        f"worker {s.index} died on start {n} times in a row (exit code "
                        f"{s.process.exitcode}): the worker cannot start with this configuration"
                    )
                if self.fatal is not None:
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


@contextlib.contextmanager
def _sigint_ignored() -> Any:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; the worker ignores SIGINT itself
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def stop_processes(procs: list[Any], timeout: float) -> None:
    """Join, then terminate, then kill whatever is still alive; never waits without a bound."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            log.info("process %s (pid %s) did not stop in time; terminating", p.name, p.pid)
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            log.error("process %s (pid %s) ignored SIGTERM; killing", p.name, p.pid)
            p.kill()
            p.join(1.0)
