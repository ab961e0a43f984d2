"""The coordinator: owns plan and index, schedules microbatches, tracks workers, serves ranks.

One thread, one ``zmq.Poller`` with a timeout (no busy loop). ROUTER sockets:
``front`` for ranks, ``back`` for local workers, ``remote`` (optional, tcp + CURVE)
for workers on other hosts. Per rank it keeps the next stream position and its
credits, produces only positions inside some rank's window and drops a finished
microbatch that left every window: memory stays bounded, and a lagging rank's
microbatch is simply rebuilt (the stream is a pure function of the seed, see
:mod:`.schedule`). Assignment runs ahead in a thread (:mod:`.assign_ahead`).
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from entrain_data import protocol
from entrain_data.errors import (
    EntrainError,
    InvalidInput,
    ProtocolError,
    ServiceStopped,
    WorkerDied,
    error_fields,
    error_from_fields,
)
from entrain_data.plan import ParallelPlan

from .assign_ahead import AssignAhead
from .config import ServiceConfig, State
from .hello import check_hello
from .pool import WorkerPool
from .sample_source import encoder_stats
from .schedule import Scheduler, data_fingerprint, digest
from .skips import SkipRecord, parse_budget
from .stats import Counters, service_stats

__all__ = ["State", "ServiceConfig", "Coordinator"]

log = logging.getLogger(__name__)

_POLL_MS = 200
_ASSIGN_POLL_MS = 5
_WORKER_CAPACITY = 2


@dataclass
class _Rank:
    ident: bytes
    rank: int
    replica: int
    next_pos: int
    credits: int = 0


class Coordinator:
    """Run with :meth:`run`; stops on the end of all epochs, :meth:`request_stop` or a signal."""

    def __init__(self, cfg: ServiceConfig, on_stats: Any = None, on_ready: Any = None) -> None:
        self.cfg = cfg
        self.on_stats = on_stats  # called with stats() every cfg.stats_interval seconds
        self.on_ready = on_ready  # called once bound and serving
        self.state = State.STARTING
        self.plan = ParallelPlan.from_json(cfg.plan_json)
        enc, llm, tokens = cfg.source.costs()
        keys = cfg.source.keys()
        self.data_fingerprint = data_fingerprint(
            enc, llm, tokens, keys, seed=cfg.seed, global_batch=self.plan.global_batch
        )
        self.fingerprint = digest([self.plan.fingerprint(), self.data_fingerprint, cfg.epochs])
        lo, hi = cfg.ranks if cfg.ranks is not None else (0, self.plan.world_size - 1)
        self.served = range(lo, hi + 1)  # the ranks of this node (serve --ranks A-B)
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
            assign_fn=cfg.assign_fn,
            max_delay=self.plan.max_delay,
            max_encoder_patches=self.plan.max_encoder_patches or None,
            encoder_stats=encoder_stats(cfg.source),
        )
        self.shape = self.scheduler.shape
        self.end_pos = cfg.epochs * self.shape.per_epoch
        self.record = SkipRecord(
            cfg.skipped_path, parse_budget(cfg.max_skipped), len(llm), lambda: keys
        )
        self._recorded_epochs: set[int] = set()
        self.ahead: AssignAhead | None = None
        self.ranks: dict[int, _Rank] = {}
        self.by_ident: dict[bytes, int] = {}
        self.done: set[int] = set()
        # (replica, pos) -> (batch frames, LLM samples in it)
        self.ready: dict[tuple[int, int], tuple[list[Any], int]] = {}
        self.queue: deque[tuple[int, int]] = deque()
        self.in_flight: dict[int, tuple[int, int]] = {}  # task id -> (replica, pos)
        self.wanted_flight: dict[tuple[int, int], int] = {}
        self.next_task = 0
        self.counters = Counters()
        self.error: EntrainError | None = None
        self._stop = False
        self._awaiting = False  # some queued microbatch waits for its assignment
        self._stop_reason = "stopped"
        self._pool_stats_fn: Any = None
        self._last_stats = time.monotonic()

    # ---------------------------------------------------------------- control
    def request_stop(self, signum: int | None = None, _frame: Any = None) -> None:
        self._stop = True
        if signum is not None:
            self._stop_reason = f"stopped by {signal.Signals(signum).name}"

    def _fail(self, front: zmq.Socket, error: EntrainError) -> None:
        """Stop with ``error``: every connected rank receives it typed, with its fields."""
        if self.error is not None:
            return
        self.error = error
        log.error("%s", error)
        for r in self.ranks.values():
            self._reply(front, r.ident, "error", error_fields(error))

    def run(self, install_signals: bool = True) -> int:
        """Serve until done or stopped; returns 0, or raises the error that stopped the service."""
        if install_signals:
            signal.signal(signal.SIGINT, self.request_stop)
            signal.signal(signal.SIGTERM, self.request_stop)
        ctx = zmq.Context()
        front = ctx.socket(zmq.ROUTER)
        back = ctx.socket(zmq.ROUTER)
        for s in (front, back):
            s.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client may reuse its identity
        remote = ctx.socket(zmq.ROUTER) if self.cfg.remote_endpoint else None
        socks = [front, back, remote]
        binds = [self.cfg.endpoint, self.cfg.worker_endpoint, self.cfg.remote_endpoint]
        for s in (front, remote):  # what crosses hosts is encrypted when keys are given
            if s is not None and self.cfg.curve_secret_key:
                s.setsockopt(zmq.LINGER, 0)
                s.curve_server = True
                s.curve_secretkey = self.cfg.curve_secret_key
                s.curve_publickey = self.cfg.curve_public_key
        pool = WorkerPool(
            back,
            endpoint=self.cfg.worker_endpoint,
            source=self.cfg.source,
            workers=self.cfg.workers,
            log_level=self.cfg.log_level,
        )
        pool.remote_timeout = self.cfg.remote_timeout
        self._pool_stats_fn = pool.stats
        try:
            for sock, ep in zip(socks, binds):
                try:
                    if sock is not None:
                        sock.bind(ep)
                except zmq.ZMQError as exc:
                    why = "address already in use" if exc.errno == zmq.EADDRINUSE else exc.strerror
                    raise InvalidInput(f"cannot serve on {ep}: {why}") from None
            self.ahead = AssignAhead(self.scheduler)
            pool.start()
            self.state = State.SERVING
            log.info("serving %s with %d workers", self.cfg.endpoint, self.cfg.workers)
            if self.on_ready is not None:
                self.on_ready()
            try:
                self._loop(front, back, pool, remote)
            except Exception as exc:  # tell every rank why, then stop (never leave them hanging)
                err = exc if isinstance(exc, EntrainError) else error_from_fields(error_fields(exc))
                self._fail(front, err)
                raise
            if self._stop and self.error is None:  # a signal: say so to ranks still reading
                why = ServiceStopped(f"{self._stop_reason} before this rank's stream ended")
                for r in self.ranks.values():
                    if r.rank not in self.done:
                        self._reply(front, r.ident, "error", error_fields(why))
        finally:
            self.state = State.DRAINING
            if self.ahead is not None:
                self.ahead.close()
            pool.stop(timeout=2.0)
            front.close(linger=500)  # the last error/end messages still leave
            back.close(linger=0)
            if remote is not None:
                remote.close(linger=200)  # the stop messages to remote workers still leave
            ctx.term()
            self.state = State.STOPPED
            log.info("stopped: %s", json.dumps(self.stats()))
        if self.error is not None:
            raise self.error
        return 0

    # ------------------------------------------------------------------- loop
    def _loop(
        self, front: zmq.Socket, back: zmq.Socket, pool: WorkerPool, remote: zmq.Socket | None
    ) -> None:
        poller = zmq.Poller()
        for s in (front, back, remote):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        drain_until: float | None = None
        while not self._stop:
            # while microbatches wait for their iteration's assignment, look again soon
            events = dict(poller.poll(_ASSIGN_POLL_MS if self._awaiting else _POLL_MS))
            if front in events:
                for _ in range(64):
                    try:
                        frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_client(front, frames)
            for sock in (back, remote):
                for _ in range(64 if sock in events else 0):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_worker(front, pool, frames, sock if sock is remote else None)
            if self._stop:
                break  # a signal arrived: do not restart workers that it may have stopped
            lost = pool.reap()
            if lost:
                self._requeue(lost)
                self.counters.tasks_reissued += len(lost)
            if pool.fatal is not None:
                self._fail(front, pool.fatal)
            elif pool.restarts > self.cfg.max_restarts:
                self._fail(front, WorkerDied(f"workers died {pool.restarts} times; giving up"))
            if self.ahead is not None and self.ahead.error is not None:
                self._fail(front, self.ahead.error)
            if self.error is None:
                self._plan_work()
                self._dispatch(back, pool)
                self._deliver(front)
            self._maybe_log_stats()
            if drain_until is None and (
                self.error is not None or len(self.done) >= len(self.served)
            ):
                drain_until = time.monotonic() + 0.5  # let the last frames leave the socket
            if drain_until is not None and time.monotonic() > drain_until:
                return

    # --------------------------------------------------------------- clients
    def _reply(self, front: zmq.Socket, ident: bytes, kind: str, fields: dict) -> None:
        front.send_multipart([ident, *protocol.encode(kind, fields)], copy=False)

    def _reject(
        self, front: zmq.Socket, ident: bytes, why: str, kind: type[EntrainError] = ProtocolError
    ) -> None:
        self.counters.rejected_messages += 1
        log.error("rejected a message from peer %r: %s", ident[:16], why)
        self._reply(front, ident, "error", error_fields(kind(why)))

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
        if self.error is not None:
            self._reply(front, ident, "error", error_fields(self.error))
            return
        try:
            rank, (epoch, it, mb), elastic = check_hello(
                h,
                ranks=self.served,
                fingerprint=self.fingerprint,
                data_fingerprint=self.data_fingerprint,
                seed=self.cfg.seed,
                shape=self.shape,
            )
        except (ProtocolError, InvalidInput) as exc:
            self._reject(front, ident, str(exc), type(exc))
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
                "data_fingerprint": self.data_fingerprint,
                "position": [epoch, it, mb],
                "replica": coords.replica,
                "stage": coords.stage,
                "seed": self.cfg.seed,
                "epochs": self.cfg.epochs,
                "iterations": self.shape.iterations,
                "microbatches": self.shape.microbatches,
            },
        )
        log.info("rank %d (replica %d) connected at %s", rank, coords.replica, (epoch, it, mb))
        if elastic:
            why = "resumes under a new plan at its iteration's start (re-assigned by this plan)"
            log.warning("rank %d %s: epoch %d iteration %d", rank, why, epoch, it)
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
        """Send queued microbatches to idle workers; ones still being assigned wait their turn."""
        assert self.ahead is not None
        waiting: deque[tuple[int, int]] = deque()
        while self.queue:
            worker = pool.idle_worker(_WORKER_CAPACITY)
            if worker is None:
                break
            replica, pos = self.queue.popleft()
            slot = self.ahead.slot(replica, pos)
            if slot is None:
                waiting.append((replica, pos))
                continue
            epoch, it, mb = self.shape.locate(pos)
            self._record_left_out(epoch)
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
                    "encoder_calls": slot.encoder_calls,
                },
            )
            pool.send(worker, tid, frames)
            self.in_flight[tid] = (replica, pos)
            self.wanted_flight[(replica, pos)] = tid
        self._awaiting = bool(waiting)
        waiting.extend(self.queue)
        self.queue = waiting

    def _record_left_out(self, epoch: int) -> None:
        if epoch not in self._recorded_epochs:
            self._recorded_epochs.add(epoch)
            self.record.add_epoch_left_out(
                epoch, self.scheduler.left_out(epoch), self.plan.dp, self.plan.microbatches
            )

    def _on_worker(
        self, front: zmq.Socket, pool: WorkerPool, frames: list[Any], remote: Any = None
    ) -> None:
        ident = frames[0].bytes
        try:
            head = protocol.decode(frames[1:2])
        except ProtocolError as exc:
            log.error("malformed message from worker %r: %s", ident, exc)
            return
        pool.seen(ident)
        if head.kind == "heartbeat":
            return
        if head.kind == "ready" and remote is not None:
            pool.join_remote(remote, ident, head.header.get("source"))
            return
        if head.kind == "ready":
            pool.mark_ready(ident)
            return
        tid = head.header.get("task")
        if head.kind == "failed" and tid is None:  # the worker could not build its packer
            pool.start_failed(ident, error_from_fields(head.header))
            return
        pool.task_done(ident, tid)
        key = self.in_flight.pop(tid, None)
        if key is None:
            return  # a task re-issued after its worker was presumed dead
        self.wanted_flight.pop(key, None)
        if head.kind == "failed":
            h = head.header
            where = (
                f"epoch {h.get('epoch')} iteration {h.get('iteration')} "
                f"microbatch {h.get('microbatch')}: "
            )
            self._fail(front, error_from_fields(h, prefix=where))
            return
        if head.kind != "result":
            log.error("unexpected %r message from worker %r", head.kind, ident)
            return
        try:
            batch = protocol.decode(frames[2:])
        except ProtocolError as exc:
            self._fail(front, ProtocolError(f"worker {ident!r} sent a malformed microbatch: {exc}"))
            return
        self.counters.tasks_done += 1
        skipped = head.header.get("skipped") or []
        if skipped:
            epoch, it, _ = self.shape.locate(key[1])
            self.record.add_skipped(skipped, epoch, it)
            self.counters.skipped = len(self.record.skipped)
            over = self.record.over_budget()
            if over is not None:
                self._fail(front, over)
                return
        pool.account(ident, sum(s.nbytes for s in batch.specs), len(batch.header["llm_keys"]))
        self.ready[key] = (list(frames[2:]), len(batch.header.get("llm_keys", [])))

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
        return service_stats(self)

    def _pool_stats(self) -> list[dict[str, Any]]:
        return self._pool_stats_fn() if self._pool_stats_fn else []

    def _maybe_log_stats(self) -> None:
        if (
            self.cfg.stats_interval
            and time.monotonic() - self._last_stats >= self.cfg.stats_interval
        ):
            self._last_stats = time.monotonic()
            (self.on_stats or (lambda st: log.info("stats %s", json.dumps(st))))(self.stats())
