"""One rank's connection to the loader service: its sockets, and microbatches not yet yielded.

A DEALER socket carries control (``hello``/``welcome``, credits, errors,
stats). When the service runs on this host the rank also binds an ipc PULL
socket in a private temp dir, with a random token beside it; the service reads
the token to prove it can reach the socket, and its workers then send this
rank's microbatches there directly (``workers/production.py``). They may arrive
out of order (several workers) and wait here, keyed by position, for their
turn; a duplicate (a task re-issued after a worker died) is dropped.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
import warnings
from typing import Any

import torch
import zmq

from . import protocol
from .errors import (
    EntrainError,
    EntrainTimeout,
    InvalidInput,
    ProtocolError,
    WorkerDied,
    error_fields,
    error_from_fields,
)
from .owned_dirs import drop_owned_dir, make_owned_dir
from .shared_batch import SegmentReader
from .tcp import HandshakeWatch, family_for, outward_address

__all__ = ["Connection", "tensors_of"]

log = logging.getLogger(__name__)

_LOST: Any = object()  # _poll_once: a message that arrived without its data
_NUDGE_S = 1.0  # direct route: seconds of waiting before the rank says what it holds

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


def tensors_of(msg: protocol.Message) -> dict[str, torch.Tensor]:
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


class Connection:
    """One connection to the service: sockets, welcome info, microbatches not yet yielded."""

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
        direct: bool = True,
    ) -> None:
        self.endpoint, self.rank, self.timeout = endpoint, rank, timeout
        # the next microbatch the rank would read, told on close: a rank that stops after
        # exactly its microbatches (a fixed step count) never sends the credit past its last
        self.position = position
        self.service = (
            service  # the handle of a service this process started; checked while waiting
        )
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.watch: HandshakeWatch | None = None  # a wrong key is told, not waited out
        self.data: zmq.Socket | None = None
        self.tcp: zmq.Socket | None = None  # direct route from workers on other hosts
        self._poller: zmq.Poller | None = None
        self._polled: tuple[Any, ...] = ()
        self.data_dir: str | None = None
        try:  # a bad endpoint or key: leave no context, monitor, socket or directory behind
            self.sock.setsockopt(zmq.LINGER, 0)
            family_for(self.sock, endpoint)
            if curve_server_key is not None:
                pub, sec = zmq.curve_keypair()
                self.sock.curve_serverkey = curve_server_key
                self.sock.curve_publickey = pub
                self.sock.curve_secretkey = sec
                self.watch = HandshakeWatch(self.sock)
            try:
                self.sock.connect(endpoint)
            except zmq.ZMQError as exc:
                raise InvalidInput(
                    f"rank {rank}: cannot connect to the loader service's endpoint "
                    f"{endpoint!r}: {exc.strerror}"
                ) from None
            offer = self._open_data_socket() if direct else None
        except BaseException:
            self.close()
            raise
        self.batches: dict[tuple[int, int, int], protocol.Message] = {}
        self.ends: set[int] = set()
        self.low = position  # batches before this are stale (re-sent after a reconnect)
        self.segments = SegmentReader(None)  # workers' segments in the service's directory
        hello = {
            "rank": rank,
            "position": list(position),
            "seed": seed,
            "fingerprint": fingerprint,
            "data_fingerprint": data_fingerprint,
            "pid": os.getpid(),
            "data": offer,
        }
        try:
            self._send("hello", hello)
            welcome = self._wait(lambda m: m.kind == "welcome", f"the welcome of rank {rank}")
        except BaseException:  # refused or timed out: leave no socket or directory behind
            self.close()
            raise
        self.info = welcome.header
        got = self.info.get("position")
        if got:  # resumed under a new plan, the service starts the rank at its iteration's start
            position = (int(got[0]), int(got[1]), int(got[2]))
            self.low = position  # and the first credit says so: that microbatch is wanted
        shm_dir = self.info.get("shm_dir")
        if isinstance(shm_dir, str) and not os.access(shm_dir, os.R_OK | os.W_OK | os.X_OK):
            shm_dir = None  # not the service's /dev/shm (another container): say so below
        self.segments = SegmentReader(shm_dir)
        self.direct = bool(self.info.get("direct")) and self.data is not None
        if not self.direct:
            self._close_data_socket()
        first: dict[str, Any] = {"n": prefetch, "next": list(position)}
        if self.info.get("shm_dir") and self.segments.root is None:
            first["shm"] = False
        try:
            if self.direct and self.info.get("remote_host"):  # workers on other hosts reach it
                first["tcp"] = self._open_tcp_socket(str(self.info["remote_host"]))
            self._send("credit", first)
        except BaseException:  # leave no socket or directory behind
            self.close()
            raise

    def _open_data_socket(self) -> dict[str, str] | None:
        """Bind an ipc PULL socket in a private temp dir, with a token the service checks.

        A socket path is at most 107 bytes: under a long ``TMPDIR`` (a Kubernetes emptyDir)
        the dir is made in ``/tmp`` instead, and where no bind works the rank takes its
        microbatches through the coordinator (None: no direct route offered)."""
        for root in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):  # once each
            try:
                self.data_dir = make_owned_dir(root, "entrain-rank-")
                token = secrets.token_hex(16)
                with open(os.path.join(self.data_dir, "token"), "w", encoding="ascii") as f:
                    f.write(token)
                self.data = self.ctx.socket(zmq.PULL)
                self.data.setsockopt(zmq.LINGER, 0)
                endpoint = f"ipc://{self.data_dir}/data.sock"
                self.data.bind(endpoint)
                return {"endpoint": endpoint, "token": token}
            except (zmq.ZMQError, OSError) as exc:
                self._close_data_socket()
                why = exc
        log.warning(
            "rank %d: no direct data socket (%s): served by the coordinator", self.rank, why
        )
        return None

    def _open_tcp_socket(self, host: str) -> dict[str, str]:
        """A tcp PULL socket, CURVE server with a fresh key pair, for remote workers.

        It binds on the host remote workers already reach (the service's remote endpoint's);
        the endpoint and public key travel to them inside their tasks, over CURVE.
        """
        pub, sec = zmq.curve_keypair()
        self.tcp = self.ctx.socket(zmq.PULL)
        self.tcp.setsockopt(zmq.LINGER, 0)
        self.tcp.curve_server = True
        self.tcp.curve_publickey, self.tcp.curve_secretkey = pub, sec
        wildcard = host in ("*", "0.0.0.0", "", "[::]", "::")
        v6 = host in ("[::]", "::")  # every interface, both families (IPv4 mapped)
        where = "tcp://[::]" if v6 else "tcp://*" if wildcard else f"tcp://{host}"
        family_for(self.tcp, where)
        try:
            port = self.tcp.bind_to_random_port(where)
        except zmq.ZMQError as exc:
            raise InvalidInput(
                f"rank {self.rank}: cannot open a socket for remote workers on {host} "
                f"(the service's remote endpoint's host): {exc.strerror}"
            ) from None
        if wildcard:  # the address other hosts reach: never this host's loopback
            control = self.endpoint[len("tcp://") :].rsplit(":", 1)[0]
            host = outward_address(control if self.endpoint.startswith("tcp://") else None)
        return {"endpoint": f"tcp://{host}:{port}", "key": pub.decode("ascii")}

    def _close_data_socket(self) -> None:
        if self.tcp is not None:
            self.tcp.close(linger=0)
            self.tcp = None
        if self.data is not None:
            self.data.close(linger=0)
            self.data = None
        if self.data_dir is not None:
            drop_owned_dir(self.data_dir)
            self.data_dir = None

    def _send(self, kind: str, fields: dict[str, Any]) -> None:
        self.sock.send_multipart(protocol.encode(kind, fields), copy=False)

    def _poll_one(self, wait: float, what: str) -> protocol.Message | None:
        """The next message from either socket within ``wait`` seconds, else None.

        A service ``error`` is raised, typed; so is the exit of a service this process started.
        A microbatch whose shared segment went with its dead worker is dropped, as if it never
        came (:meth:`next_batch` asks for what it lacks).
        """
        deadline = time.monotonic() + wait
        while True:
            msg = self._poll_once(max(deadline - time.monotonic(), 0.0), what)
            if msg is not _LOST:
                return msg

    def _poll_once(self, wait: float, what: str) -> protocol.Message | None:
        socks = (self.sock, self.data, self.tcp)
        if self._poller is None or self._polled != socks:  # built once per set of sockets
            self._poller, self._polled = zmq.Poller(), socks
            for s in socks:
                if s is not None:
                    self._poller.register(s, zmq.POLLIN)
        poller = self._poller
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            events = dict(poller.poll(int(min(max(left, 0), 0.5) * 1000) + 1)) if left > 0 else {}
            if events:
                break
            if self.service is not None and not self.service.alive():
                self._service_gone(what)
            if self.watch is not None and self.watch.refused():
                raise InvalidInput(
                    f"rank {self.rank}: the loader service at {self.endpoint} refused the "
                    "encryption handshake: is curve_server_key its public key?"
                )
            if time.monotonic() >= deadline:
                return None
        sock = next(s for s in (self.sock, self.data, self.tcp) if s is not None and s in events)
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1 and sock is self.data:  # maybe in a worker's shared segment
            head = protocol.decode_header(frames[0])
            if head.get("shm") is not None:
                if self._stale(head):  # a duplicate: free its slot unread
                    self.segments.release(head["shm"])
                    return protocol.Message("batch", head)
                views = self.segments.views(head["shm"], head.get("tensors", []))
                if views is None:
                    log.info("rank %d: a shared microbatch went with its worker: %s", self.rank,
                             {k: head.get(k) for k in ("epoch", "iteration", "microbatch")})  # fmt: skip
                    return _LOST
                frames = [frames[0], *views]
        msg = protocol.decode(frames)
        if msg.kind == "error":  # typed as the service raised it (SampleError: source, key)
            raise error_from_fields(msg.header, prefix=f"loader service at {self.endpoint}: ")
        return msg

    def _timeout(self, what: str, timeout: float) -> EntrainTimeout:
        return EntrainTimeout(
            f"rank {self.rank}: waited {timeout:g}s for {what} from {self.endpoint}; "
            "is the loader service running?"
        )

    def _recv_one(self, timeout: float, what: str) -> protocol.Message:
        msg = self._poll_one(timeout, what)
        if msg is None:
            raise self._timeout(what, timeout)
        return msg

    def _stale(self, h: dict[str, Any]) -> bool:
        try:
            return (int(h["epoch"]), int(h["iteration"]), int(h["microbatch"])) < self.low
        except (KeyError, TypeError, ValueError):
            return False  # _file names the malformed header

    def _file(self, msg: protocol.Message) -> bool:
        """Keep a microbatch until its turn, an epoch's end marker; False for anything else."""
        if msg.kind == "end":
            self.ends.add(int(msg.header.get("epoch", -1)))
            return True
        if msg.kind != "batch":
            return False
        h = msg.header
        try:
            key = (int(h["epoch"]), int(h["iteration"]), int(h["microbatch"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"rank {self.rank}: a microbatch without its position") from exc
        if key >= self.low:  # an earlier one is a duplicate (a task re-issued): dropped
            self.batches.setdefault(key, msg)
        return True

    def next_batch(self, pos: tuple[int, int, int], what: str, timeout: float) -> protocol.Message:
        """The microbatch at ``pos``, filing any that arrive before it.

        On the direct route a microbatch can be lost with a worker killed after it
        reported the send (its socket's queue dies with it): every ``_NUDGE_S`` of
        waiting, the rank tells the service what it holds, and the service sends
        again whatever it believed delivered but two reports in a row lacked (one can
        cross a microbatch still in the pipe).
        """
        self.low = pos
        deadline = time.monotonic() + timeout
        while pos not in self.batches:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(what, timeout)
            msg = self._poll_one(min(left, _NUDGE_S) if self.direct else left, what)
            if msg is None:
                if self.direct:
                    have = [list(k) for k in sorted(self.batches)]
                    self._send("credit", {"n": 0, "next": list(pos), "have": have})
                continue
            if not self._file(msg):
                raise ProtocolError(f"unexpected {msg.kind!r} message while waiting for {what}")
        return self.batches.pop(pos)

    def wait_end(self, epoch: int, timeout: float) -> None:
        what = f"the end of epoch {epoch}"
        while epoch not in self.ends:
            msg = self._recv_one(timeout, what)
            if not self._file(msg):
                raise ProtocolError(f"rank {self.rank}: expected {what}, received {msg.kind!r}")
        self.ends.discard(epoch)

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
        """Receive until ``match``; microbatches and end markers are kept for the iterator."""
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._recv_one(max(deadline - time.monotonic(), 0.0), what)
            if match(msg):
                return msg
            if not self._file(msg):
                log.warning("rank %d: ignored a %r message", self.rank, msg.kind)

    def close(self) -> None:
        sent = False
        try:
            if not self.sock.closed:
                bye = protocol.encode("bye", {"next": list(self.position)})
                self.sock.send_multipart(bye, zmq.NOBLOCK)
                sent = True
        except zmq.ZMQError:
            pass
        if self.watch is not None:
            self.watch.close()
        self.sock.close(linger=200 if sent else 0)  # long enough for the bye to leave
        self._close_data_socket()
        self.ctx.term()
