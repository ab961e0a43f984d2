"""``EntrainLoader``: a training rank's iterator over its microbatches, served by the loader service.

The client is a thin facade over :class:`_Conn` (one DEALER socket). It says
``hello`` (rank, protocol version, where to start), receives the plan's view of
this rank, and grants the service ``prefetch`` credits: the service never sends
more than that ahead, so prefetching happens in ZeroMQ's I/O thread and memory
stays bounded. Tensors are ``torch.frombuffer`` views of the received frames (no
copy); treat them as read-only. Every wait has a timeout and raises
:class:`~entrain_data.errors.EntrainTimeout` naming the epoch, iteration,
microbatch and endpoint it waited for.

Resume state is five scalars (epoch, iteration, microbatch of the next
microbatch to yield; seed; plan fingerprint): the service's stream is a pure
function of them.
"""

from __future__ import annotations

import collections
import logging
import os
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import zmq

from . import protocol
from .batch import Microbatch
from .errors import (
    EntrainError,
    EntrainTimeout,
    InvalidInput,
    ProtocolError,
    WorkerDied,
    error_fields,
    error_from_fields,
)

__all__ = ["EntrainLoader"]

log = logging.getLogger(__name__)

_TORCH_DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def _tensors(msg: protocol.Message) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frames are read-only buffers: no copy
        for spec, buf in zip(msg.specs, msg.buffers):
            dt = _TORCH_DTYPES[spec.dtype]
            if spec.nbytes == 0:
                out[spec.name] = torch.empty(spec.shape, dtype=dt)
            else:
                out[spec.name] = torch.frombuffer(buf, dtype=dt).reshape(spec.shape)
    return out


class _Conn:
    """One connection to the service: socket, welcome info, received-but-unyielded messages."""

    def __init__(
        self,
        endpoint: str,
        rank: int,
        position: tuple[int, int, int],
        seed: int | None,
        fingerprint: str | None,
        data_fingerprint: str | None,
        prefetch: int,
        timeout: float,
        curve_server_key: bytes | None,
        service: Any = None,
    ) -> None:
        self.endpoint, self.rank, self.timeout = endpoint, rank, timeout
        self.service = (
            service  # the handle of a service this process started; checked while waiting
        )
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            pub, sec = zmq.curve_keypair()
            self.sock.curve_serverkey = curve_server_key
            self.sock.curve_publickey = pub
            self.sock.curve_secretkey = sec
        self.sock.connect(endpoint)
        self.pending: collections.deque[protocol.Message] = collections.deque()
        self._send(
            "hello",
            {
                "rank": rank,
                "position": list(position),
                "seed": seed,
                "fingerprint": fingerprint,
                "data_fingerprint": data_fingerprint,
                "pid": os.getpid(),
            },
        )
        welcome = self._wait(lambda m: m.kind == "welcome", f"the welcome of rank {rank}")
        self.info = welcome.header
        self._send("credit", {"n": prefetch})

    def _send(self, kind: str, fields: dict[str, Any]) -> None:
        self.sock.send_multipart(protocol.encode(kind, fields), copy=False)

    def recv(self, timeout: float, what: str) -> protocol.Message:
        if self.pending:
            return self.pending.popleft()
        return self._recv_one(timeout, what)

    def _recv_one(self, timeout: float, what: str) -> protocol.Message:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(min(left, 0.5) * 1000) + 1):
                if self.service is not None and not self.service.alive():
                    self._service_gone(what)
                if time.monotonic() >= deadline:
                    raise EntrainTimeout(
                        f"rank {self.rank}: waited {timeout:g}s for {what} from {self.endpoint}; "
                        "is the loader service running?"
                    )
                continue
            frames = self.sock.recv_multipart(copy=False)
            msg = protocol.decode(frames)
            if msg.kind == "error":  # typed as the service raised it (SampleError: source, key)
                raise error_from_fields(msg.header, prefix=f"loader service at {self.endpoint}: ")
            return msg

    def _service_gone(self, what: str) -> None:
        """The service this process started has exited: raise why (its own error, typed)."""
        failure = self.service.failure()
        if isinstance(failure, EntrainError):
            raise error_from_fields(
                error_fields(failure),
                prefix=f"rank {self.rank}: the loader service at {self.endpoint} exited: ",
            )
        code = self.service.process.exitcode
        raise WorkerDied(
            f"rank {self.rank}: the loader service at {self.endpoint} exited (code {code}) "
            f"while waiting for {what} (see its log for the reason)"
        )

    def _wait(self, match: Any, what: str) -> protocol.Message:
        """Receive until ``match``; other messages are kept, in order, for the iterator."""
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._recv_one(max(deadline - time.monotonic(), 0.0), what)
            if match(msg):
                return msg
            self.pending.append(msg)

    def close(self) -> None:
        try:
            if not self.sock.closed:
                self.sock.send_multipart(protocol.encode("bye", {}), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)
        self.ctx.term()


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


def _close(conn_box: list[_Conn | None], service: Any) -> None:
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
    """

    def __init__(
        self,
        endpoint: str,
        rank: int,
        *,
        prefetch: int = 4,
        timeout: float = 60.0,
        curve_server_key: bytes | None = None,
        _service: Any = None,
    ) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise InvalidInput(f"rank must be an integer >= 0, got {rank!r}")
        if prefetch < 1:
            raise InvalidInput(f"prefetch must be >= 1, got {prefetch}")
        self.endpoint, self.rank = endpoint, rank
        self.prefetch, self.timeout = prefetch, float(timeout)
        self._curve = curve_server_key
        self._position = (0, 0, 0)
        self._owed = False  # a yielded microbatch whose credit is not yet returned
        self._expect_end: int | None = None  # the epoch whose end marker is still to come
        self._seed: int | None = None
        self._fingerprint: str | None = None
        self._data_fingerprint: str | None = None
        self._box: list[_Conn | None] = [None]
        self._service = _service
        self._finalizer = weakref.finalize(self, _close, self._box, _service)

    # ----------------------------------------------------------- constructors
    @classmethod
    def local(
        cls, *, rank: int = 0, prefetch: int = 4, timeout: float = 60.0, **service_options: Any
    ) -> EntrainLoader:
        """Start a loader service for this (single-node) job and connect to it.

        ``service_options`` go to ``entrain_data.workers.service.start_service``
        (``index=``, ``plan=``, ``workers=``, ``seed=``, ``epochs=``,
        ``on_error=`` ...). The service stops when this loader is closed.
        """
        # imported here, not at module level: the core never imports workers/ on import
        from entrain_data.workers.service import start_service

        service = start_service(**service_options)
        return cls(service.endpoint, rank, prefetch=prefetch, timeout=timeout, _service=service)

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
        return cls(service.endpoint, rank, prefetch=prefetch, timeout=timeout, _service=service)

    # ---------------------------------------------------------------- state
    def _conn(self) -> _Conn:
        if self._box[0] is None:
            self._box[0] = _Conn(
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
                conn._send("credit", {"n": 1})
                self._owed = False
            if self._expect_end is not None:
                msg = conn.recv(self.timeout, f"the end of epoch {self._expect_end}")
                if msg.kind != "end" or msg.header.get("epoch") != self._expect_end:
                    raise ProtocolError(
                        f"rank {self.rank}: expected the end of epoch {self._expect_end}, "
                        f"received {msg.kind!r}"
                    )
                self._expect_end = None
                return
            epoch, it, mb = self._position
            what = f"epoch {epoch} iteration {it} microbatch {mb}"
            msg = conn.recv(self.timeout, what)
            if msg.kind != "batch":
                raise ProtocolError(f"unexpected {msg.kind!r} message while waiting for {what}")
            got = (
                msg.header.get("epoch"),
                msg.header.get("iteration"),
                msg.header.get("microbatch"),
            )
            if got != (epoch, it, mb):
                raise ProtocolError(f"rank {self.rank}: expected {what}, received {got}")
            batch = Microbatch.from_tensors(msg.header, _tensors(msg))
            per_it = conn.info["microbatches"]
            it, mb = divmod(it * per_it + mb + 1, per_it)
            if it == conn.info["iterations"]:
                self._position = (epoch + 1, 0, 0)
                self._expect_end = epoch
            else:
                self._position = (epoch, it, mb)
            self._owed = True
            yield batch

    def stats(self) -> dict[str, Any]:
        """The service's counters (served, queues, workers, skipped, assignment latency)."""
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
