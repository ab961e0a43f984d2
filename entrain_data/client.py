"""``EntrainLoader``: a training rank's iterator over its microbatches, served by the loader service.

The client is a thin facade over :class:`~entrain_data.connection.Connection`
(control socket to the service, and on the service's host a data socket its
workers deliver to directly). It says ``hello`` (rank, protocol version, where
to start, its data socket), receives the plan's view of this rank, and grants
the service ``prefetch`` credits: no more than that many microbatches are ever
sent ahead, so prefetching happens in ZeroMQ's I/O thread and memory stays
bounded. Tensors are
``torch.frombuffer`` views of the received frames (no copy); treat them as
read-only. Every wait has a timeout and raises
:class:`~entrain_data.errors.EntrainTimeout` naming the epoch, iteration,
microbatch and endpoint it waited for.

Resume state is five scalars (epoch, iteration, microbatch of the next
microbatch to yield; seed; plan fingerprint): the service's stream is a pure
function of them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .batch import Microbatch
from .connection import Connection, tensors_of
from .errors import InvalidInput

__all__ = ["EntrainLoader"]

log = logging.getLogger(__name__)


def _check_job_agrees(rank: int, fingerprint: str | None, endpoint: str) -> None:
    """With torch.distributed initialised, every rank's service must serve the same stream.

    One service per node computes the global schedule from (plan, seed, index content);
    two that disagree would silently duplicate and lose samples, so they are refused
    here, on every rank, before the first microbatch. A collective: every rank reaches it
    on its first use of the loader (``iter``, ``info`` or ``stats``).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, [fingerprint, endpoint])
    if len({fp for fp, _ in seen}) > 1:
        groups: dict[str, list[int]] = {}
        for r, (fp, _) in enumerate(seen):
            groups.setdefault(str(fp), []).append(r)
        detail = "; ".join(f"ranks {v} -> service {k}" for k, v in groups.items())
        raise InvalidInput(
            f"rank {rank}: the loader services of this job disagree ({detail}): start every "
            "node's service with the same plan, seed, epochs and index content"
        )


def _close(conn_box: list[Connection | None], service: Any) -> None:
    conn = conn_box[0]
    if conn is not None:
        conn.close()
        conn_box[0] = None
    if service is not None:
        service.close()


class EntrainLoader:
    """Iterate this rank's microbatches for one epoch at a time, in order.

    ``EntrainLoader(endpoint=..., rank=R)`` connects to a running service (R is
    the global rank; the plan the service sends maps it to its replica).
    ``prefetch`` microbatches may be in flight; ``timeout`` bounds every wait.
    ``curve_server_key`` (the service's public key) enables CURVE on tcp.
    ``direct=False`` asks for every microbatch through the coordinator even when the
    service is on this host (the route of earlier releases; for comparison).
    """

    def __init__(
        self,
        endpoint: str,
        rank: int,
        *,
        prefetch: int = 4,
        timeout: float = 60.0,
        curve_server_key: bytes | None = None,
        direct: bool = True,
        _service: Any = None,
    ) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise InvalidInput(f"rank must be an integer >= 0, got {rank!r}")
        if prefetch < 1:
            raise InvalidInput(f"prefetch must be >= 1, got {prefetch}")
        self.endpoint, self.rank = endpoint, rank
        self.prefetch, self.timeout = prefetch, float(timeout)
        self._curve = curve_server_key
        self._direct = direct
        self._position = (0, 0, 0)
        self._owed = False  # a yielded microbatch whose credit is not yet returned
        self._expect_end: int | None = None  # the epoch whose end marker is still to come
        self._seed: int | None = None
        self._fingerprint: str | None = None
        self._data_fingerprint: str | None = None
        self._box: list[Connection | None] = [None]
        self._service = _service
        self._finalizer = weakref.finalize(self, _close, self._box, _service)

    # ----------------------------------------------------------- constructors
    @classmethod
    def local(
        cls,
        *,
        rank: int = 0,
        prefetch: int = 4,
        timeout: float = 60.0,
        direct: bool = True,
        **service_options: Any,
    ) -> EntrainLoader:
        """Start a loader service for this (single-node) job and connect to it.

        ``service_options`` go to ``entrain_data.workers.service.start_service``
        (``index=``, ``plan=``, ``workers=``, ``seed=``, ``epochs=``,
        ``on_error=`` ...). The service stops when this loader is closed.
        """
        # imported here, not at module level: the core never imports workers/ on import
        from entrain_data.workers.service import start_service

        service = start_service(**service_options)
        return cls(
            service.endpoint,
            rank,
            prefetch=prefetch,
            timeout=timeout,
            direct=direct,
            _service=service,
        )

    @classmethod
    def wrap(
        cls,
        dataloader_or_dataset: Any,
        cost_fn: Any = None,
        *,
        plan: Any = None,
        rank: int = 0,
        workers: int | None = None,
        prefetch: int = 4,
        timeout: float = 60.0,
        direct: bool = True,
        **service_options: Any,
    ) -> EntrainLoader:
        """Run a user's torch ``Dataset`` (or a ``DataLoader``'s dataset and collate) in the pool.

        ``cost_fn(i) -> (encoder_cost, llm_cost, tokens)`` prices sample ``i`` so
        the assignment can balance; or ``sizes_fn=`` (sizes per sample) with ``model=``.
        Without ``plan`` the plan is derived from that profile (``world_size=``, default
        torch.distributed's). The dataset (and collate) must be picklable. Microbatch
        keys are the dataset indices as strings. Options and refusals:
        ``entrain_data.workers.wrap_dataset``.
        """
        from entrain_data.workers.service import start_for_dataset  # see local()

        service = start_for_dataset(
            dataloader_or_dataset, cost_fn, plan=plan, workers=workers, rank=rank, **service_options
        )
        return cls(
            service.endpoint,
            rank,
            prefetch=prefetch,
            timeout=timeout,
            direct=direct,
            _service=service,
        )

    # ---------------------------------------------------------------- state
    def _conn(self) -> Connection:
        if self._box[0] is None:
            self._box[0] = Connection(
                self.endpoint,
                self.rank,
                self._position,
                self._seed,
                self._fingerprint,
                self._data_fingerprint,
                self.prefetch,
                self.timeout,
                self._curve,
                self._service,
                self._direct,
            )
            info = self._box[0].info
            self._seed, self._fingerprint = info["seed"], info["fingerprint"]
            self._data_fingerprint = info.get("data_fingerprint")
            start = tuple(info.get("position") or self._position)
            if start != self._position:  # resumed under a new plan: at its iteration's start
                log.warning(
                    "rank %d: resuming at epoch %d iteration %d microbatch %d (a new plan "
                    "re-assigns the whole iteration; asked for %s)",
                    self.rank,
                    *start,
                    self._position,
                )
                self._position = start  # type: ignore[assignment]
            _check_job_agrees(self.rank, self._fingerprint, self.endpoint)
        return self._box[0]

    @property
    def info(self) -> dict[str, Any]:
        """What the service said on connect: plan (JSON), replica, stage, seed, epochs, sizes."""
        return dict(self._conn().info)

    def state_dict(self) -> dict[str, Any]:
        """Resume state: the next microbatch to yield, the seed and the plan fingerprint."""
        epoch, it, mb = self._position
        return {
            "rank": self.rank,
            "epoch": epoch,
            "iteration": it,
            "microbatch": mb,
            "seed": self._seed,
            "fingerprint": self._fingerprint,
            "data_fingerprint": self._data_fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the service refuses a different seed or plan."""
        try:
            pos = (int(state["epoch"]), int(state["iteration"]), int(state["microbatch"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"loader state: missing or bad field ({exc})") from exc
        if state.get("rank", self.rank) != self.rank:
            raise InvalidInput(
                f"loader state is for rank {state['rank']}, this loader is rank {self.rank}"
            )
        conn, self._box[0] = self._box[0], None
        if conn is not None:
            conn.close()
        self._owed, self._expect_end = False, None
        self._position = pos
        self._seed = state.get("seed")
        self._fingerprint = state.get("fingerprint")
        self._data_fingerprint = state.get("data_fingerprint")

    # ------------------------------------------------------------- iterating
    def __iter__(self) -> Iterator[Microbatch]:
        """This rank's microbatches of the current epoch; the next ``iter()`` starts the next."""
        conn = self._conn()
        if self._position[0] >= conn.info["epochs"] and self._expect_end is None:
            return
        while True:
            if self._owed:  # the consumer is done with the last microbatch: one more may come
                conn._send("credit", {"n": 1, "next": list(self._position)})
                self._owed = False
            if self._expect_end is not None:
                if not conn.direct:  # the coordinator marks the end after the last one it sent
                    conn.wait_end(self._expect_end, self.timeout)
                self._expect_end = None
                return
            epoch, it, mb = self._position
            what = f"epoch {epoch} iteration {it} microbatch {mb}"
            msg = conn.next_batch(self._position, what, self.timeout)
            batch = Microbatch.from_tensors(msg.header, tensors_of(msg))
            per_it = conn.info["microbatches"]
            it, mb = divmod(it * per_it + mb + 1, per_it)
            if it == conn.info["iterations"]:
                self._position = (epoch + 1, 0, 0)
                self._expect_end = epoch
            else:
                self._position = (epoch, it, mb)
            conn.position = self._position
            self._owed = True
            yield batch

    def stats(self) -> dict[str, Any]:
        """The service's counters (served, queues, workers, skipped, assignment latency), as
        the coordinator has them now: a worker reports a microbatch (and the samples it
        skipped) after delivering it, so what a rank has just received may be counted a
        moment later."""
        conn = self._conn()
        conn._send("stats", {})
        return dict(conn._wait(lambda m: m.kind == "stats", "a stats reply").header["stats"])

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Disconnect (and stop the service if this loader started it)."""
        self._finalizer()

    def __enter__(self) -> EntrainLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
