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
from entrain_data.errors import EntrainError, InvalidInput, WorkerDied, error_fields
from entrain_data.shared_batch import remove_segments

from .sample_source import SampleSource
from .worker import run_worker

__all__ = ["WorkerPool", "stop_processes"]

log = logging.getLogger(__name__)

RESTART_WINDOW = 600.0
"""Seconds over which worker restarts count against ``max_restarts``."""

_START_FAILURES = 2  # consecutive deaths before "ready" that make a configuration error


@dataclass
class _Slot:
    index: int
    generation: int
    process: Any  # None for a remote worker (its host, or Ray, runs it)
    ready: bool = False
    name: bytes = b""  # a remote worker's identity
    sock: Any = None  # a remote worker's socket (local ones share ``back``)
    last_seen: float = field(default_factory=time.monotonic)
    outstanding: set[int] = field(default_factory=set)
    tasks: int = 0
    samples: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def ident(self) -> bytes:
        return self.name or f"w{self.index}.{self.generation}".encode()


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
        self.restarts = 0  # over the run (stats)
        self._deaths: list[float] = []  # when each restart happened (monotonic seconds)
        self.fatal: EntrainError | None = None
        self._start_failures: dict[int, int] = {}
        self._joined: set[bytes] = set()  # remote workers whose index was checked
        self.remote_timeout = 30.0  # seconds without a word before a remote worker is dead
        self._source_id: str | None = None  # the source's identity, computed once
        self.shared_dir: str | None = None  # where workers keep segments for this host's ranks

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

    def seen(self, ident: bytes, remote: zmq.Socket | None = None) -> None:
        """A message from ``ident``; a remote worker dropped as silent (a long task, a network
        blip) that speaks again joins again: it was checked when it first joined."""
        s = self._slot(ident)
        if s is not None:
            s.last_seen = time.monotonic()
        elif remote is not None and ident in self._joined:
            log.warning("remote worker %s speaks again: rejoined", ident.decode(errors="replace"))
            self.add_remote(ident, remote)

    def join_remote(self, sock: zmq.Socket, ident: bytes, source_id: Any) -> None:
        """A remote worker joins only if it packs the same samples (its index's content hash)."""
        if self._source_id is None:
            self._source_id = str(getattr(self.source, "identity", lambda: "")())
        if source_id != self._source_id:
            log.error(
                "refused remote worker %r: its index %s is not this service's %s",
                ident,
                source_id,
                self._source_id,
            )
            why = f"its index {source_id} is not the service's {self._source_id}"
            sock.send_multipart([ident, *protocol.encode("error", error_fields(InvalidInput(why)))])
            return
        self._joined.add(ident)
        self.add_remote(ident, sock)

    def add_remote(self, ident: bytes, sock: zmq.Socket) -> None:
        """A worker on another host said ``ready``: it takes tasks like a local one."""
        old = self._slot(ident)
        if old is not None:
            old.ready, old.last_seen = True, time.monotonic()
            return
        index = max((s.index for s in self.slots), default=-1) + 1
        self.slots.append(_Slot(index, 0, None, ready=True, name=ident, sock=sock))
        log.info("remote worker %s joined as worker %d", ident.decode(errors="replace"), index)

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
        (slot.sock or self.back).send_multipart([slot.ident, *frames], copy=False)
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

    def reap(self) -> tuple[list[int], list[int]]:
        """Restart every dead worker; returns the task ids dead workers held and those silent
        remote workers held (to re-issue; only a death counts against a microbatch, a silence
        may be a slow build).

        A worker that dies before ``ready`` twice in a row sets :attr:`fatal` instead.
        """
        lost: list[int] = []
        silent: list[int] = []
        now = time.monotonic()
        for s in [s for s in self.slots if s.process is None]:
            if now - s.last_seen > self.remote_timeout:  # silent: presumed dead, not restarted
                log.error(
                    "remote worker %s silent for %.0fs holding %d task(s); re-issuing them",
                    s.ident.decode(errors="replace"),
                    now - s.last_seen,
                    len(s.outstanding),
                )
                silent.extend(sorted(s.outstanding))
                self.slots.remove(s)
        for i, s in enumerate(self.slots):
            if s.process is None or s.process.is_alive():
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
            if self.shared_dir is not None:  # its segments: ranks that map one keep it
                remove_segments(self.shared_dir, s.ident.decode())
            self.restarts += 1
            self._deaths.append(time.monotonic())
            self.slots[i] = self._spawn(s.index, s.generation + 1)
        return lost, silent

    def recent_restarts(self, window: float = RESTART_WINDOW) -> int:
        """Restarts within the last ``window`` seconds: a multi-day run that loses a worker
        now and then (an OOM kill) keeps going; one whose workers keep dying stops."""
        cut = time.monotonic() - window
        self._deaths = [t for t in self._deaths if t >= cut]
        return len(self._deaths)

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for s in self.slots:
            up = max(time.monotonic() - s.started, 1e-9)
            out.append(
                {
                    "worker": s.index,
                    "pid": s.process.pid if s.process is not None else None,
                    "remote": s.name.decode(errors="replace") if s.name else None,
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
            if s.process is None or s.process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    sock = s.sock or self.back
                    sock.send_multipart([s.ident, *protocol.encode("stop")], zmq.NOBLOCK)
        stop_processes([s.process for s in self.slots if s.process is not None], timeout)


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
