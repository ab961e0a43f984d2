"""What the coordinator produces and where each microbatch goes: windows, queue, flights, delivery.

A rank is served by one of two routes, chosen at its ``hello``:

- **direct**: the rank is on this host (its ``hello`` named an ipc data socket this
  service can reach, see :func:`reachable_data_endpoint`). The task names the rank
  as a destination and the worker that packs the microbatch sends it straight to
  the rank; the coordinator sees only the worker's short report of who was
  reached. No payload byte passes through the coordinator.
- **hop**: any other rank (another host, ``direct=False``). The worker returns the
  payload; the coordinator keeps it in ``ready`` while some rank's window holds it
  and forwards it (zero-copy frames), less the frames of the encoder inputs the
  rank's stage never reads (:func:`.delivery.without_unread`: the direct route's rule,
  applied to the relayed message; the variant is built once per stage kind).

Windows bound memory on both routes. A hop rank's window starts at the next
position to send and reaches as far as its credits (at least ``window``); a
direct rank's starts at the next position it will *yield* (every credit says
which) and holds ``prefetch`` positions; a task also names the replica's other
direct ranks up to twice that far ahead (peers that read the same microbatch a
moment later), so one build serves them all and a rank's reorder buffer holds at
most ``2 x prefetch``.
A position that left every window is dropped; the stream is a pure function of
the seed, so anything dropped, lost with a worker or sent to a rank that has
since reconnected is simply rebuilt.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from entrain_data.errors import ProtocolError, WorkerDied
from entrain_data.shared_batch import drop_shared_dir, make_shared_dir

from .delivery import without_unread

__all__ = [
    "RankState",
    "Flight",
    "Production",
    "reachable_data_endpoint",
    "remote_host",
    "poison_error",
]

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (replica, stream position)

POISON_LOSSES = 3
"""Deaths of the workers building one microbatch after which the service stops and names it:
a sample that crashes the decoder (a segfault, an OOM kill) would otherwise kill worker
after worker until the restart limit, with no word of which sample it was."""


@dataclass
class RankState:
    """One connected rank, as the coordinator tracks it."""

    ident: bytes
    rank: int
    replica: int
    next_pos: int  # hop: the next position to send; direct: the next the rank will yield
    credits: int = 0  # hop: microbatches it may still be sent
    data: str | None = None  # direct: the rank's ipc data socket
    unread: tuple[str, ...] = ()  # encoder inputs its pipeline stage never reads (not sent)
    remote: tuple[str, str] | None = (
        None  # direct: its tcp socket and CURVE key, for remote workers
    )
    ahead: int = 0  # direct: the prefetch it granted (positions past next_pos it may hold)
    shm: bool = True  # direct: it can map workers' segments (sees the service's /dev/shm)
    sent: set[int] = field(default_factory=set)  # direct: delivered, not yet yielded
    flying: set[int] = field(default_factory=set)  # direct: in a task that names it
    sent_remote: set[int] = field(default_factory=set)  # direct: of ``sent``, by remote workers
    unheld: set[int] = field(default_factory=set)  # direct: of ``sent``, missing at one report

    def credit(self, h: dict[str, Any], position: Callable[..., int], end_pos: int) -> None:
        """A ``credit``: a hop rank may be sent ``n`` more; a direct rank says where it is
        (``next``) and, while it waits, what it holds (``have``): anything believed
        delivered but missing from two reports in a row was lost on the way (a worker
        killed before its socket flushed) and is sent again. One report is not enough: a
        worker reports its send once the bytes are queued, so a rank's report can cross a
        microbatch still in the pipe, which was then sent twice (and counted twice).
        Raises ProtocolError for a malformed field."""
        n = h.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 1 << 20:
            raise ProtocolError(f"bad credit count {n!r}")
        self.credits += n
        if self.data is None:
            return
        self.ahead = max(self.ahead, n)  # the first credit is the rank's prefetch
        if h.get("shm") is False:  # another /dev/shm (a container): bytes by socket
            self.shm = False
        tcp = h.get("tcp")
        if isinstance(tcp, dict):
            ep, key = tcp.get("endpoint"), tcp.get("key")
            if not (isinstance(ep, str) and ep.startswith("tcp://") and isinstance(key, str)):
                raise ProtocolError(f"bad tcp data socket {tcp!r} in a credit")
            if len(key) != 40:
                raise ProtocolError("a CURVE public key is 40 Z85 characters")
            self.remote = (ep, key)
        try:
            if h.get("next") is not None:
                pos = position(*(int(x) for x in h["next"]))
                self.next_pos = max(self.next_pos, min(pos, end_pos))
            if isinstance(h.get("have"), list):
                held = {position(*(int(x) for x in k)) for k in h["have"]}
                missing = self.sent - held
                lost = missing & self.unheld  # missing from the last report too
                self.unheld = missing - lost
                if self.remote is not None and lost & self.sent_remote:
                    log.warning(
                        "rank %d: a microbatch sent to %s by a remote worker never arrived; "
                        "remote workers' microbatches for it now go through the coordinator",
                        self.rank,
                        self.remote[0],
                    )
                    self.remote = None  # unreachable from there (a firewall?): hop instead
                self.sent -= lost
                self.sent_remote -= lost
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"bad position in a credit: {exc}") from None


@dataclass
class Flight:
    """A task on its way: its microbatch, the ranks it goes to directly (over ipc, or over
    tcp from a remote worker), and whether the coordinator wants the payload back."""

    key: Key
    dests: list[tuple[int, bytes]]  # (rank, identity at dispatch)
    payload: bool
    remote: bool = False


def reachable_data_endpoint(data: Any) -> str | None:
    """The rank's ipc data socket if this process can reach it, else None (serve by hop).

    The rank writes a random token beside its socket and sends it in ``hello``:
    reading the same token here proves both see one filesystem (one host, one
    mount namespace), which a hostname alone does not (containers).
    """
    if not isinstance(data, dict):
        return None
    endpoint, token = data.get("endpoint"), data.get("token")
    if not (isinstance(endpoint, str) and isinstance(token, str) and token):
        return None
    if not endpoint.startswith("ipc://"):
        return None
    path = os.path.join(os.path.dirname(endpoint[len("ipc://") :]), "token")
    try:
        with open(path, encoding="ascii") as f:
            return endpoint if f.read(128).strip() == token else None
    except (OSError, UnicodeDecodeError):
        return None


def remote_host(endpoint: str | None) -> str | None:
    """HOST of the remote workers' tcp://HOST:PORT: where they reach this node, so where its
    direct ranks bind the tcp sockets those workers send to."""
    return endpoint[len("tcp://") :].rsplit(":", 1)[0] if endpoint else None


class Production:
    """The queue of microbatches to build, the tasks in flight and the payloads held."""

    def __init__(self, window: int, end_pos: int) -> None:
        self.window, self.end_pos = window, end_pos
        self.ready: dict[Key, tuple[list[Any], int]] = {}  # payload frames, LLM samples
        # relayed variants of ready payloads, less what a kind of stage never reads
        self.variants: dict[tuple[Key, tuple[str, ...]], list[Any]] = {}
        self.queue: deque[Key] = deque()
        self.in_flight: dict[int, Flight] = {}
        self.wanted_flight: dict[Key, int] = {}  # key -> task bringing its payload back
        self.shared_dir: str | None = None  # workers' segments for ranks on this host
        self.losses: Counter[Key] = Counter()  # microbatches whose worker died building them

    def open_shared(self) -> None:
        """Let workers hand this host's ranks microbatches in shared memory from now on."""
        self.shared_dir = make_shared_dir()

    def close(self) -> None:
        if self.shared_dir is not None:
            drop_shared_dir(self.shared_dir)
            self.shared_dir = None

    # ---------------------------------------------------------------- windows
    def _hop_window(self, r: RankState) -> range:
        ahead = max(self.window, min(r.credits, 4 * self.window))  # bounded
        return range(r.next_pos, min(r.next_pos + ahead, self.end_pos))

    def _direct_window(self, r: RankState) -> range:
        return range(r.next_pos, min(r.next_pos + r.ahead, self.end_pos))

    def _needs(self, r: RankState, pos: int, stretch: int = 1) -> bool:
        """A direct rank needs ``pos``: in its window (``stretch`` times as long), neither
        delivered nor on its way."""
        return (
            r.next_pos <= pos < min(r.next_pos + stretch * r.ahead, self.end_pos)
            and pos not in r.sent
            and pos not in r.flying
        )

    def plan(self, ranks: list[RankState]) -> None:
        """Drop what left every window; queue what some window needs and nothing brings."""
        hop: set[Key] = set()
        direct: set[Key] = set()
        for r in ranks:
            if r.data is None:
                hop.update((r.replica, p) for p in self._hop_window(r))
            else:
                r.sent = {p for p in r.sent if p >= r.next_pos}
                r.sent_remote &= r.sent
                r.unheld &= r.sent
                direct.update((r.replica, p) for p in self._direct_window(r) if self._needs(r, p))
        for key in [k for k in self.ready if k not in hop and k not in direct]:
            del self.ready[key]
        for vkey in [v for v in self.variants if v[0] not in self.ready]:
            del self.variants[vkey]
        need = {k for k in hop if k not in self.ready and k not in self.wanted_flight}
        need |= {k for k in direct if k not in self.ready}
        self.queue = deque(k for k in self.queue if k in need)
        queued = set(self.queue)
        for key in sorted(need - queued, key=lambda k: (k[1], k[0])):
            self.queue.append(key)

    # ---------------------------------------------------------------- flights
    def take(self, ranks: list[RankState], key: Key, *, remote: bool) -> Flight | None:
        """The flight for ``key`` now, or None if nothing needs it any more.

        ``remote``: a worker on another host; it reaches direct ranks over their tcp sockets
        (CURVE), and where one has none it returns the payload, which then goes by hop.
        """
        replica, pos = key
        direct = [r for r in ranks if r.data is not None and r.replica == replica]
        # peers (tensor-parallel ranks, later stages) a little behind the first that needs it
        # get it in the same task, so it is built once: a rank may then hold 2 x prefetch
        needers = [r for r in direct if self._needs(r, pos, 2)] if key not in self.ready else []
        if not any(self._needs(r, pos) for r in needers):
            needers = []
        hop = key not in self.ready and key not in self.wanted_flight
        hop = hop and any(
            r.data is None and r.replica == replica and pos in self._hop_window(r) for r in ranks
        )
        if not needers and not hop:
            return None
        if remote and any(r.remote is None for r in needers):
            if key in self.wanted_flight:
                return None  # its payload is already on the way; it serves them all
            return Flight(key, [], True)
        return Flight(key, [(r.rank, r.ident) for r in needers], hop, remote)

    def route(self, flight: Flight, by_rank: dict[int, RankState]) -> dict[str, Any]:
        """The task's routing fields: where the worker sends it, and what it returns."""
        deliver = []
        for rank, _ in flight.dests:
            r = by_rank[rank]
            if flight.remote and r.remote is not None:
                deliver.append([rank, r.remote[0], list(r.unread), r.remote[1]])
            else:
                deliver.append([rank, r.data, list(r.unread)])
        # another host's /dev/shm is not ours; a rank that cannot see ours takes the bytes by socket
        local = not flight.remote and all(by_rank[rank].shm for rank, _ in flight.dests)
        shared = self.shared_dir if local else None
        return {"deliver": deliver, "payload": flight.payload, "shared": shared}

    def launched(self, tid: int, flight: Flight, by_rank: dict[int, RankState]) -> None:
        self.in_flight[tid] = flight
        if flight.payload:
            self.wanted_flight[flight.key] = tid
        for rank, _ in flight.dests:
            by_rank[rank].flying.add(flight.key[1])

    def _settle(self, tid: int, by_rank: dict[int, RankState], reached: set[int]) -> Flight | None:
        flight = self.in_flight.pop(tid, None)
        if flight is None:
            return None  # a task re-issued after its worker was presumed dead
        if self.wanted_flight.get(flight.key) == tid:
            del self.wanted_flight[flight.key]
        pos = flight.key[1]
        for rank, ident in flight.dests:
            r = by_rank.get(rank)
            if r is None or r.ident != ident:
                continue  # the rank reconnected since: its new connection asks again
            r.flying.discard(pos)
            if rank in reached:
                r.sent.add(pos)
                if flight.remote:
                    r.sent_remote.add(pos)
        return flight

    def lost(self, tids: list[int], by_rank: dict[int, RankState], died: bool = True) -> list[Key]:
        """Tasks whose worker died (or, ``died=False``, fell silent): whatever they were to bring
        is needed again. Returns the microbatches lost :data:`POISON_LOSSES` times to deaths
        (every worker that builds them dies)."""
        doomed = []
        for tid in tids:
            flight = self._settle(tid, by_rank, set())
            if flight is not None:
                self.queue.appendleft(flight.key)
                self.losses[flight.key] += died
                if died and self.losses[flight.key] >= POISON_LOSSES:
                    doomed.append(flight.key)
        return doomed

    def landed(
        self,
        tid: int,
        by_rank: dict[int, RankState],
        reached: set[int],
        payload: tuple[list[Any], int] | None,
    ) -> Flight | None:
        """A task's result: the ranks it reached and its payload if it brought one back."""
        flight = self._settle(tid, by_rank, reached)
        if flight is not None:
            self.losses.pop(flight.key, None)
            if payload is not None:
                self.ready[flight.key] = payload
                for vkey in [v for v in self.variants if v[0] == flight.key]:
                    del self.variants[vkey]  # built from the payload it replaces
        return flight

    def failed(self, tid: int, by_rank: dict[int, RankState]) -> Flight | None:
        return self._settle(tid, by_rank, set())

    # --------------------------------------------------------------- delivery
    def deliverable(self, r: RankState) -> list[tuple[int, list[Any], int]]:
        """Payloads held here that ``r`` may be sent now: (position, frames, samples), in order.

        A hop rank takes them strictly in order, one credit each; a direct rank takes
        any in its window it has not got (a payload a remote worker brought back). Either
        gets the frames without the tensors its stage never reads (``r.unread``).
        """
        out: list[tuple[int, list[Any], int]] = []
        if r.data is None:
            pos, credits = r.next_pos, r.credits
            while credits > 0 and pos < self.end_pos and (key := (r.replica, pos)) in self.ready:
                out.append((pos, self._frames(key, r.unread), self.ready[key][1]))
                pos, credits = pos + 1, credits - 1
            return out
        for pos in self._direct_window(r):
            key = (r.replica, pos)
            if key in self.ready and pos not in r.sent and pos not in r.flying:
                out.append((pos, self._frames(key, r.unread), self.ready[key][1]))
        return out

    def _frames(self, key: Key, unread: tuple[str, ...]) -> list[Any]:
        """The ready payload of ``key`` as a rank that never reads ``unread`` is sent it: built
        once for all such ranks (tensor-parallel peers, the replica's other LLM-only stages)."""
        frames = self.ready[key][0]
        if not unread:
            return frames
        variant = self.variants.get((key, unread))
        if variant is None:
            variant = self.variants[(key, unread)] = without_unread(frames, unread)
        return variant


def poison_error(key: Key, shape: Any, slot: Any, keys: list[str] | None) -> WorkerDied:
    """The error that stops a service whose workers keep dying on one microbatch: it names
    the microbatch and its samples (the index's keys, else their rows)."""
    replica, pos = key
    epoch, it, mb = shape.locate(pos)
    rows = [] if slot is None else np.concatenate([slot.encoder_rows, slot.llm_rows])
    names = [keys[i] if keys else f"row {i}" for i in np.unique(rows).astype(int).tolist()]
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return WorkerDied(
        f"epoch {epoch} iteration {it} microbatch {mb} of replica {replica}: its worker died "
        f"each of the {POISON_LOSSES} times it built this microbatch (a sample that crashes "
        f"the decoder, or one larger than a worker's memory); its samples: "
        f"{', '.join(names[:8]) or '?'}{more}"
    )
