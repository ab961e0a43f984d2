"""The coordinator: owns plan and index, schedules microbatches, tracks workers, serves ranks.

One thread, one ``zmq.Poller`` with a timeout (an idle service sleeps in
``poll``; no busy loop). Two ROUTER sockets: ``front`` for clients (one DEALER
per rank), ``back`` for workers. Per rank the coordinator keeps the next stream
position and the credits the client granted; it produces (through workers) only
the positions inside some rank's window ``[next, next + window)`` and drops any
finished microbatch that left every window, so memory is bounded whatever the
consumers do, and a slow rank never makes a fast one lose data: a microbatch a
lagging rank needs again is simply rebuilt (the stream is a pure function of
the seed, see :mod:`.schedule`).
"""

from __future__ import annotations

import enum
import json
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from entrain_data import protocol
from entrain_data.errors import EntrainError, ProtocolError, SampleError, WorkerDied
from entrain_data.plan import ParallelPlan

from .schedule import Scheduler
from .worker import WorkerPool

__all__ = ["State", "ServiceConfig", "Coordinator"]

log = logging.getLogger(__name__)

_POLL_MS = 200
_WORKER_CAPACITY = 2


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ServiceConfig:
    """Everything a coordinator needs; picklable (it crosses a spawn boundary)."""

    plan_json: str
    endpoint: str
    worker_endpoint: str
    packer_factory: Any  # picklable callable -> Packer, run in each worker
    table_costs: Any  # callable -> (encoder_cost [N, E], llm_cost [N], tokens [N], n)
    workers: int = 2
    seed: int = 0
    epochs: int = 1
    window: int = 4
    curve_secret_key: bytes | None = None
    curve_public_key: bytes | None = None
    skipped_path: str | None = None
    max_restarts: int = 20
    log_level: int = logging.WARNING
    stats_interval: float = 0.0  # seconds between logged stats lines; 0: never


@dataclass
class _Rank:
    ident: bytes
    rank: int
    replica: int
    next_pos: int
    credits: int = 0


@dataclass
class _Counters:
    started: float = field(default_factory=time.monotonic)
    microbatches: int = 0
    samples: int = 0
    bytes: int = 0
    tasks_done: int = 0
    tasks_reissued: int = 0
    rejected_messages: int = 0
    skipped: int = 0


class Coordinator:
    """Run with :meth:`run`; stops on the end of all epochs, :meth:`request_stop` or a signal."""

    def __init__(self, cfg: ServiceConfig, on_stats: Any = None) -> None:
        self.cfg = cfg
        self.on_stats = on_stats  # called with stats() every cfg.stats_interval seconds
        self.state = State.STARTING
        self.plan = ParallelPlan.from_json(cfg.plan_json)
        self.fingerprint = self.plan.fingerprint()
        enc, llm, tokens = cfg.table_costs()
        self.scheduler = Scheduler(
            enc,
            llm,
            tokens,
            dp=self.plan.dp,
            microbatches=self.plan.microbatches,
            global_batch=self.plan.global_batch,
            max_tokens=self.plan.max_tokens,
            defer_budget=self.plan.defer_budget,
            method=self.plan.method,
            seed=cfg.seed,
        )
        self.shape = self.scheduler.shape
        self.end_pos = cfg.epochs * self.shape.per_epoch
        self.ranks: dict[int, _Rank] = {}
        self.by_ident: dict[bytes, int] = {}
        self.done: set[int] = set()
        # (replica, pos) -> (batch frames, LLM samples in it)
        self.ready: dict[tuple[int, int], tuple[list[Any], int]] = {}
        self.queue: deque[tuple[int, int]] = deque()
        self.in_flight: dict[int, tuple[int, int]] = {}  # task id -> (replica, pos)
        self.wanted_flight: dict[tuple[int, int], int] = {}
        self.next_task = 0
        self.counters = _Counters()
        self.skipped_keys: set[str] = set()
        self.error: str | None = None
        self._stop = False
        self._pool_stats_fn: Any = None
        self._last_stats = time.monotonic()

    # ---------------------------------------------------------------- control
    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def run(self, install_signals: bool = True) -> int:
        """Serve until done or stopped; returns 0, or raises the sample error under ``raise``."""
        if install_signals:
            signal.signal(signal.SIGINT, self.request_stop)
            signal.signal(signal.SIGTERM, self.request_stop)
        ctx = zmq.Context()
        front = ctx.socket(zmq.ROUTER)
        back = ctx.socket(zmq.ROUTER)
        for s in (front, back):
            s.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client may reuse its identity
        if self.cfg.curve_secret_key:
            front.curve_server = True
            front.curve_secretkey = self.cfg.curve_secret_key
            front.curve_publickey = self.cfg.curve_public_key
        pool = WorkerPool(self.cfg, back)
        self._pool_stats_fn = pool.stats
        try:
            front.bind(self.cfg.endpoint)
            back.bind(self.cfg.worker_endpoint)
            pool.start()
            self.state = State.SERVING
            log.info("serving %s with %d workers", self.cfg.endpoint, self.cfg.workers)
            try:
                self._loop(front, back, pool)
            except Exception as exc:  # tell every rank why, then stop (never leave them hanging)
                for r in self.ranks.values():
                    self._reply(front, r.ident, "error", {"message": f"service failed: {exc}"})
                raise
        finally:
            self.state = State.DRAINING
            pool.stop()
            front.close(linger=0)
            back.close(linger=0)
            ctx.term()
            self.state = State.STOPPED
            log.info("stopped: %s", json.dumps(self.stats()))
        if self.error is not None:
            raise SampleError(self.error)
        return 0

    # ------------------------------------------------------------------- loop
    def _loop(self, front: zmq.Socket, back: zmq.Socket, pool: WorkerPool) -> None:
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        drain_until: float | None = None
        while not self._stop:
            events = dict(poller.poll(_POLL_MS))
            if front in events:
                for _ in range(64):
                    try:
                        frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_client(front, frames)
            if back in events:
                for _ in range(64):
                    try:
                        frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_worker(front, pool, frames)
            lost = pool.reap()
            if lost:
                self._requeue(lost)
                self.counters.tasks_reissued += len(lost)
            if pool.restarts > self.cfg.max_restarts:
                raise WorkerDied(f"workers died {pool.restarts} times; giving up")
            if self.error is None:
                self._plan_work()
                self._dispatch(back, pool)
                self._deliver(front)
            self._maybe_log_stats()
            if drain_until is None and (
                self.error is not None or len(self.done) >= self.plan.world_size
            ):
                drain_until = time.monotonic() + 0.5  # let the last frames leave the socket
            if drain_until is not None and time.monotonic() > drain_until:
                return

    # --------------------------------------------------------------- clients
    def _reply(self, front: zmq.Socket, ident: bytes, kind: str, fields: dict) -> None:
        front.send_multipart([ident, *protocol.encode(kind, fields)], copy=False)

    def _reject(self, front: zmq.Socket, ident: bytes, why: str) -> None:
        self.counters.rejected_messages += 1
        log.error("rejected a message from peer %r: %s", ident[:16], why)
        self._reply(front, ident, "error", {"message": why})

    def _on_client(self, front: zmq.Socket, frames: list[Any]) -> None:
        ident = frames[0].bytes
        try:
            msg = protocol.decode(frames[1:])
        except ProtocolError as exc:
            self._reject(front, ident, str(exc))
            return
        if msg.kind == "hello":
            self._hello(front, ident, msg.header)
            return
        rank = self.by_ident.get(ident)
        if rank is None:
            self._reject(front, ident, f"unknown peer sent {msg.kind!r} before hello")
            return
        if msg.kind == "credit":
            n = msg.header.get("n")
            if not isinstance(n, int) or n < 0 or n > 1 << 20:
                self._reject(front, ident, f"bad credit count {n!r}")
                return
            self.ranks[rank].credits += n
        elif msg.kind == "stats":
            self._reply(front, ident, "stats", {"stats": self.stats()})
        elif msg.kind == "bye":
            self.by_ident.pop(ident, None)
            self.ranks.pop(rank, None)
        else:
            self._reject(front, ident, f"unexpected {msg.kind!r} message from rank {rank}")

    def _hello(self, front: zmq.Socket, ident: bytes, h: dict) -> None:
        rank = h.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self.plan.world_size:
            self._reject(front, ident, f"rank {rank!r} outside 0..{self.plan.world_size - 1}")
            return
        if self.error is not None:
            self._reply(front, ident, "error", {"message": self.error})
            return
        want = h.get("fingerprint")
        if want is not None and want != self.fingerprint:
            self._reject(
                front,
                ident,
                f"resume state is for plan {want}, this service serves {self.fingerprint}",
            )
            return
        if h.get("seed") is not None and h.get("seed") != self.cfg.seed:
            self._reject(
                front,
                ident,
                f"resume state has seed {h.get('seed')}, service seed is {self.cfg.seed}",
            )
            return
        pos = h.get("position") or [0, 0, 0]
        try:
            epoch, it, mb = (int(x) for x in pos)
        except (TypeError, ValueError):
            self._reject(front, ident, f"bad start position {pos!r}")
            return
        if not (
            0 <= it < self.shape.iterations and 0 <= mb < self.shape.microbatches and epoch >= 0
        ):
            self._reject(front, ident, f"start position {pos!r} outside the stream")
            return
        coords = self.plan.rank_coords(rank)
        old = self.ranks.get(rank)
        if old is not None:
            self.by_ident.pop(old.ident, None)
        self.ranks[rank] = _Rank(ident, rank, coords.replica, self.shape.position(epoch, it, mb))
        self.by_ident[ident] = rank
        self.done.discard(rank)
        self._reply(
            front,
            ident,
            "welcome",
            {
                "plan": self.cfg.plan_json,
                "fingerprint": self.fingerprint,
                "replica": coords.replica,
                "stage": coords.stage,
                "seed": self.cfg.seed,
                "epochs": self.cfg.epochs,
                "iterations": self.shape.iterations,
                "microbatches": self.shape.microbatches,
            },
        )
        log.info("rank %d (replica %d) connected at %s", rank, coords.replica, (epoch, it, mb))
        if self.ranks[rank].next_pos >= self.end_pos:
            self.done.add(rank)

    # ------------------------------------------------------------ production
    def _wanted(self) -> set[tuple[int, int]]:
        want: set[tuple[int, int]] = set()
        for r in self.ranks.values():
            ahead = max(self.cfg.window, min(r.credits, 4 * self.cfg.window))  # bounded
            hi = min(r.next_pos + ahead, self.end_pos)
            want.update((r.replica, p) for p in range(r.next_pos, hi))
        return want

    def _plan_work(self) -> None:
        want = self._wanted()
        for key in [k for k in self.ready if k not in want]:
            del self.ready[key]
        self.queue = deque(k for k in self.queue if k in want)
        queued = set(self.queue)
        for key in sorted(want, key=lambda k: (k[1], k[0])):
            if key not in self.ready and key not in self.wanted_flight and key not in queued:
                self.queue.append(key)

    def _requeue(self, task_ids: list[int]) -> None:
        for tid in task_ids:
            key = self.in_flight.pop(tid, None)
            if key is not None:
                self.wanted_flight.pop(key, None)
                self.queue.appendleft(key)

    def _dispatch(self, back: zmq.Socket, pool: WorkerPool) -> None:
        while self.queue:
            worker = pool.idle_worker(_WORKER_CAPACITY)
            if worker is None:
                return
            replica, pos = self.queue.popleft()
            epoch, it, mb = self.shape.locate(pos)
            try:
                slot = self.scheduler.slot(replica, pos)
            except EntrainError as exc:
                self.error = f"assignment of epoch {epoch} iteration {it} failed: {exc}"
                log.error("%s", self.error)
                return
            tid = self.next_task
            self.next_task += 1
            frames = protocol.encode(
                "task",
                {
                    "task": tid,
                    "epoch": epoch,
                    "iteration": it,
                    "microbatch": mb,
                    "replica": replica,
                    "encoder_rows": slot.encoder_rows.tolist(),
                    "llm_rows": slot.llm_rows.tolist(),
                },
            )
            pool.send(worker, tid, frames)
            self.in_flight[tid] = (replica, pos)
            self.wanted_flight[(replica, pos)] = tid

    def _on_worker(self, front: zmq.Socket, pool: WorkerPool, frames: list[Any]) -> None:
        ident = frames[0].bytes
        try:
            head = protocol.decode(frames[1:2])
        except ProtocolError as exc:
            log.error("malformed message from worker %r: %s", ident, exc)
            return
        if head.kind == "ready":
            pool.mark_ready(ident)
            return
        tid = head.header.get("task")
        pool.task_done(ident, tid)
        key = self.in_flight.pop(tid, None)
        if key is None:
            return  # a task re-issued after its worker was presumed dead
        self.wanted_flight.pop(key, None)
        if head.kind == "failed":
            h = head.header
            self.error = (
                f"sample error in epoch {h.get('epoch')} iteration {h.get('iteration')} "
                f"microbatch {h.get('microbatch')}: {h.get('error')}"
            )
            log.error("%s", self.error)
            for r in self.ranks.values():
                self._reply(front, r.ident, "error", {"message": self.error})
            return
        if head.kind != "result":
            log.error("unexpected %r message from worker %r", head.kind, ident)
            return
        try:
            batch = protocol.decode(frames[2:])
        except ProtocolError as exc:
            self.error = f"worker {ident!r} sent a malformed microbatch: {exc}"
            return
        self.counters.tasks_done += 1
        self._record_skipped(head.header.get("skipped") or [])
        pool.account(ident, sum(s.nbytes for s in batch.specs), len(batch.header["llm_keys"]))
        self.ready[key] = (list(frames[2:]), len(batch.header.get("llm_keys", [])))

    def _record_skipped(self, skipped: list[dict]) -> None:
        new = [s for s in skipped if s.get("key") not in self.skipped_keys]
        if not new:
            return
        for s in new:
            self.skipped_keys.add(s.get("key"))
            log.warning(
                "skipped sample %s in %s: %s", s.get("key"), s.get("source"), s.get("error")
            )
        self.counters.skipped = len(self.skipped_keys)
        if self.cfg.skipped_path:
            with open(self.cfg.skipped_path, "a", encoding="utf-8") as f:
                for s in new:
                    f.write(json.dumps(s) + "\n")

    # -------------------------------------------------------------- delivery
    def _deliver(self, front: zmq.Socket) -> None:
        for r in list(self.ranks.values()):
            while r.credits > 0 and r.next_pos < self.end_pos:
                item = self.ready.get((r.replica, r.next_pos))
                if item is None:
                    break
                frames, nsamples = item
                self.counters.samples += nsamples
                front.send_multipart([r.ident, *frames], copy=False)
                self.counters.microbatches += 1
                self.counters.bytes += sum(len(f) for f in frames[1:])
                r.credits -= 1
                r.next_pos += 1
                epoch, it, mb = self.shape.locate(r.next_pos - 1)
                if it == self.shape.iterations - 1 and mb == self.shape.microbatches - 1:
                    self._reply(front, r.ident, "end", {"epoch": epoch})
                if r.next_pos >= self.end_pos:
                    self.done.add(r.rank)

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        c = self.counters
        lat = self.scheduler.latencies
        return {
            "state": self.state.value,
            "uptime_s": round(time.monotonic() - c.started, 3),
            "microbatches_served": c.microbatches,
            "bytes_served": c.bytes,
            "samples_served": c.samples,
            "tasks_done": c.tasks_done,
            "tasks_reissued": c.tasks_reissued,
            "rejected_messages": c.rejected_messages,
            "skipped_samples": c.skipped,
            "queue": {
                "ready": len(self.ready),
                "queued": len(self.queue),
                "in_flight": len(self.in_flight),
            },
            "ranks": {str(r.rank): r.next_pos for r in self.ranks.values()},
            "assignment_latency_s": {
                "count": len(lat),
                "mean": (sum(lat) / len(lat)) if lat else 0.0,
                "max": max(lat, default=0.0),
            },
            "workers": self._pool_stats(),
        }

    def _pool_stats(self) -> list[dict[str, Any]]:
        return self._pool_stats_fn() if self._pool_stats_fn else []

    def _maybe_log_stats(self) -> None:
        iv = self.cfg.stats_interval
        if iv and time.monotonic() - self._last_stats >= iv:
            self._last_stats = time.monotonic()
            if self.on_stats is not None:
                self.on_stats(self.stats())
            else:
                log.info("stats %s", json.dumps(self.stats()))
