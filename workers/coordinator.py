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
import math
import signal
import time
from collections import deque
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

from . import ipc_claim
from .assign_ahead import AssignAhead
from .config import ServiceConfig, State
from .delivery import unread_features
from .hello import check_hello, past_end
from .pool import WorkerPool
from .production import (
    Production,
    RankState,
    poison_error,
    reachable_data_endpoint,
    remote_host,
)
from .schedule import Scheduler, data_fingerprint, digest
from .skips import SkipRecord, parse_budget
from .sockets import open_sockets
from .stats import Counters, service_stats

__all__ = ["State", "ServiceConfig", "Coordinator"]

log = logging.getLogger(__name__)

_POLL_MS = 200
_ASSIGN_POLL_MS = 5
_WORKER_CAPACITY = 2


class Coordinator:
    """Run with :meth:`run`; stops on the end of all epochs, :meth:`request_stop` or a signal."""

    def __init__(self, cfg: ServiceConfig, on_stats: Any = None, on_ready: Any = None) -> None:
        self.cfg = cfg
        self.on_stats = on_stats  # called with stats() every cfg.stats_interval seconds
        self.on_ready = on_ready  # called once bound and serving
        self.state = State.STARTING
        self.plan = ParallelPlan.from_json(cfg.plan_json)
        enc, llm, tokens = cfg.source.costs()
        self.keys = keys = cfg.source.keys()
        self.data_fingerprint = data_fingerprint(
            enc, llm, tokens, keys, seed=cfg.seed, global_batch=self.plan.global_batch
        )
        self.fingerprint = digest([self.plan.fingerprint(), self.data_fingerprint, cfg.epochs])
        lo, hi = cfg.ranks if cfg.ranks is not None else (0, self.plan.world_size - 1)
        self.served = range(lo, hi + 1)  # the ranks of this node (serve --ranks A-B)
        self.scheduler = Scheduler.for_plan(
            self.plan, (enc, llm, tokens), seed=cfg.seed, source=cfg.source, assign_fn=cfg.assign_fn
        )
        self.scheduler.check_fits(keys)
        self.shape = self.scheduler.shape
        self.end_pos = cfg.epochs * self.shape.per_epoch
        self.record = SkipRecord(
            cfg.skipped_path, parse_budget(cfg.max_skipped), len(llm), lambda: keys
        )
        self._recorded_epochs: set[int] = set()
        self.ahead: AssignAhead | None = None
        self.ranks: dict[int, RankState] = {}
        self.by_ident: dict[bytes, int] = {}
        self.done: set[int] = set()
        self.production = Production(cfg.window, self.end_pos)
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
        claims: list[tuple[str, int | None]] = []
        try:  # each ipc path ours before the bind, until the sockets are closed (ipc_claim)
            for ep in (self.cfg.endpoint, self.cfg.worker_endpoint):
                claims.append((ep, ipc_claim.claim(ep)))
            front, back, remote = open_sockets(ctx, self.cfg)
        except BaseException:
            ctx.term()
            for ep, fd in claims:
                ipc_claim.release(ep, fd)
            self.state = State.STOPPED
            raise
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
            self.ahead = AssignAhead(self.scheduler)
            self.production.open_shared()  # this host's ranks read workers' segments
            pool.shared_dir = self.production.shared_dir
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
            pool.stop(timeout=2.0)  # first: no worker then writes a segment into the folder
            self.production.close()
            front.close(linger=500)  # the last error/end messages still leave
            back.close(linger=0)
            if remote is not None:
                remote.close(linger=200)  # the stop messages to remote workers still leave
            ctx.term()
            for ep, fd in claims:
                ipc_claim.release(ep, fd)
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
        settle = math.inf  # a stop still takes the results in flight (their skips), 0.5 s at most
        while not self._stop or (self.production.in_flight and time.monotonic() < settle):
            settle = time.monotonic() + 0.5 if self._stop and settle == math.inf else settle
            # while microbatches wait for their iteration's assignment, look again soon
            events = dict(poller.poll(_ASSIGN_POLL_MS if self._awaiting else _POLL_MS))
            for sock in (back, remote):  # results first: a rank's next request may follow one
                for _ in range(64 if sock in events else 0):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_worker(front, pool, frames, sock if sock is remote else None)
            if front in events:
                for _ in range(64):
                    try:
                        frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_client(front, frames)
            if self._stop:
                continue  # a signal arrived: do not restart workers that it may have stopped
            lost, silent = pool.reap()
            self.production.lost(silent, self.ranks, died=False)
            if lost or silent:
                doomed = self.production.lost(lost, self.ranks)
                self.counters.tasks_reissued += len(lost) + len(silent)
                for key in doomed:  # assigned: ahead holds it
                    self._fail(
                        front, poison_error(key, self.shape, self.ahead.slot(*key), self.keys)
                    )
            if pool.fatal is not None:
                self._fail(front, pool.fatal)
            elif (n := pool.recent_restarts()) > self.cfg.max_restarts:
                self._fail(front, WorkerDied(f"workers died {n} times in 10 minutes; giving up"))
            if self.ahead is not None and self.ahead.error is not None:
                self._fail(front, self.ahead.error)
            if self.error is None:
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
            r = self.ranks[rank]
            try:
                r.credit(msg.header, self.shape.position, self.end_pos)
            except ProtocolError as exc:
                self._reject(front, ident, str(exc))
            if r.data is not None and r.next_pos >= self.end_pos:
                self.done.add(rank)
        elif msg.kind == "stats":
            self._reply(front, ident, "stats", {"stats": self.stats()})
        elif msg.kind == "bye":  # a rank that leaves past its last microbatch is done
            self.by_ident.pop(ident, None)
            self.ranks.pop(rank, None)
            if past_end(msg.header.get("next"), self.cfg.epochs):
                self.done.add(rank)
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
        if old is not None and old.ident != ident and old.ident in self.by_ident:
            del self.by_ident[old.ident]
            why = f"rank {rank} said hello from another connection, which replaces this one"
            log.warning("%s (a restarted process, or two processes with one rank?)", why)
            self._reply(front, old.ident, "error", error_fields(InvalidInput(why)))
        stage = self.plan.stages[coords.stage]
        self.ranks[rank] = RankState(
            ident,
            rank,
            coords.replica,
            self.shape.position(epoch, it, mb),
            data=reachable_data_endpoint(h.get("data")),
            unread=unread_features(self.plan, stage),
        )
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
                "direct": self.ranks[rank].data is not None,
                "shm_dir": self.production.shared_dir,
                "remote_host": remote_host(self.cfg.remote_endpoint),
            },
        )
        route = "direct" if self.ranks[rank].data else "by the coordinator"
        log.info(
            "rank %d (replica %d) at %s, served %s", rank, coords.replica, (epoch, it, mb), route
        )
        if elastic:
            why = "resumes under a new plan at its iteration's start (re-assigned by this plan)"
            log.warning("rank %d %s: epoch %d iteration %d", rank, why, epoch, it)
        if self.ranks[rank].next_pos >= self.end_pos:
            self.done.add(rank)

    # ------------------------------------------------------------ production
    def _dispatch(self, back: zmq.Socket, pool: WorkerPool) -> None:
        """Send queued microbatches to idle workers; ones still being assigned wait their turn."""
        assert self.ahead is not None
        prod = self.production
        prod.plan(list(self.ranks.values()))
        waiting: deque[tuple[int, int]] = deque()
        while prod.queue:
            worker = pool.idle_worker(_WORKER_CAPACITY)
            if worker is None:
                break
            replica, pos = key = prod.queue.popleft()
            slot = self.ahead.slot(replica, pos)
            if slot is None:
                waiting.append(key)
                continue
            flight = prod.take(list(self.ranks.values()), key, remote=worker.process is None)
            if flight is None:
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
                    **prod.route(flight, self.ranks),
                },
            )
            pool.send(worker, tid, frames)
            prod.launched(tid, flight, self.ranks)
        self._awaiting = bool(waiting)
        waiting.extend(prod.queue)
        prod.queue = waiting

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
        pool.seen(ident, remote)
        if head.kind == "heartbeat":  # answered: a remote worker stops when none come back
            if remote is not None:
                answer = {"silence": 2 * self.cfg.remote_timeout}  # as long as it waits, twice
                remote.send_multipart([ident, *protocol.encode("heartbeat", answer)])
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
        h = head.header
        if head.kind == "failed":
            if self.production.failed(tid, self.ranks) is None:
                return  # a task re-issued after its worker was presumed dead
            where = (
                f"epoch {h.get('epoch')} iteration {h.get('iteration')} "
                f"microbatch {h.get('microbatch')}: "
            )
            self._fail(front, error_from_fields(h, prefix=where))
            return
        if head.kind != "result":
            log.error("unexpected %r message from worker %r", head.kind, ident)
            return
        payload = None
        if len(frames) > 2:
            try:
                batch = protocol.decode(frames[2:])
            except ProtocolError as exc:
                why = f"worker {ident!r} sent a malformed microbatch: {exc}"
                self._fail(front, ProtocolError(why))
                return
            payload = (list(frames[2:]), len(batch.header.get("llm_keys", [])))
        reached = {int(x) for x in h.get("reached") or []}
        flight = self.production.landed(tid, self.ranks, reached, payload)
        if flight is None:
            return
        self.counters.tasks_done += 1
        samples, nbytes = int(h.get("samples", 0)), int(h.get("nbytes", 0))
        self.counters.microbatches += len(reached)
        self.counters.samples += samples * len(reached)
        self.counters.bytes += int(h.get("sent_bytes", 0))
        self.counters.shared += int(h.get("shared_bytes", 0))
        skipped = h.get("skipped") or []
        if skipped:
            epoch, it, _ = self.shape.locate(flight.key[1])
            self.record.add_skipped(skipped, epoch, it)
            self.counters.skipped = len(self.record.skipped)
            over = self.record.over_budget()
            if over is not None:
                self._fail(front, over)
                return
        pool.account(ident, nbytes, samples)

    # -------------------------------------------------------------- delivery
    def _deliver(self, front: zmq.Socket) -> None:
        """Forward payloads held here (hop ranks; direct ranks a remote worker packed for)."""
        for r in list(self.ranks.values()):
            for pos, frames, nsamples in self.production.deliverable(r):
                front.send_multipart([r.ident, *frames], copy=False)
                self.counters.samples += nsamples
                self.counters.microbatches += 1
                nbytes = sum(len(f) for f in frames[1:])
                self.counters.bytes += nbytes
                self.counters.relayed += nbytes
                if r.data is not None:
                    r.sent.add(pos)
                    continue
                r.credits -= 1
                r.next_pos += 1
                epoch, it, mb = self.shape.locate(pos)
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
        every = self.cfg.stats_interval
        if every and time.monotonic() - self._last_stats >= every:
            self._last_stats = time.monotonic()
            (self.on_stats or (lambda st: log.info("stats %s", json.dumps(st))))(self.stats())
