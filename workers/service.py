"""Start and stop the loader service: in the foreground (``entrain-data serve``) or as a child.

:func:`start_service` spawns the coordinator (which spawns its workers) and
returns a :class:`ServiceHandle`; the handle's ``close()`` (also a context
manager and a ``weakref.finalize``) stops it with join -> terminate -> kill and
removes the ipc socket files. The coordinator's own lifecycle is the
:class:`~.coordinator.State` machine (starting, serving, draining, stopped).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import stat
import tempfile
import weakref
from pathlib import Path
from typing import Any

from entrain_data.errors import (
    AddressInUse,
    EntrainError,
    EntrainTimeout,
    InvalidInput,
    error_fields,
    error_from_fields,
)
from entrain_data.owned_dirs import drop_owned_dir, hold_in_child, hold_owned_dir, make_owned_dir
from entrain_data.plan import ParallelPlan
from entrain_data.shared_batch import remove_shared_dirs

from . import ipc_claim
from .coordinator import Coordinator, ServiceConfig
from .pool import stop_processes
from .sample_source import CustomSource, IndexSource, SampleSource
from .skips import parse_budget

__all__ = [
    "ServiceHandle",
    "check_endpoint",
    "parse_ranks",
    "remote_source",
    "make_config",
    "serve_foreground",
    "start_for_dataset",
    "start_service",
]

log = logging.getLogger(__name__)


def _plan_json(plan: ParallelPlan | str | os.PathLike) -> str:
    if isinstance(plan, ParallelPlan):
        return plan.to_json()
    path = Path(plan)
    if not path.is_file():
        raise InvalidInput(f"plan file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(
            f"{path}: not a plan (binary file; give the JSON written by `entrain-data plan`)"
        ) from None
    return ParallelPlan.from_json(text, origin=str(path)).to_json()


def parse_ranks(ranks: str | tuple[int, int] | None, world_size: int) -> tuple[int, int] | None:
    """``"A-B"`` (inclusive) or ``(A, B)``: the ranks one node's service serves, inside the plan."""
    if ranks is None:
        return None
    try:
        if isinstance(ranks, str):
            a, sep, b = ranks.partition("-")
            lo, hi = int(a), int(b if sep else a)
        else:
            lo, hi = (int(x) for x in ranks)
    except (TypeError, ValueError):
        raise InvalidInput(f"ranks must be A-B (inclusive), got {ranks!r}") from None
    if not 0 <= lo <= hi < world_size:
        raise InvalidInput(f"ranks {lo}-{hi} outside the plan's ranks 0-{world_size - 1}")
    return lo, hi


def check_endpoint(endpoint: str) -> str:
    """``ipc://PATH`` (its folder must exist) or ``tcp://HOST:PORT`` with a port in 1..65535."""
    if endpoint.startswith("ipc://"):
        folder = os.path.dirname(endpoint[len("ipc://") :]) or "."
        if not os.path.isdir(folder):
            raise InvalidInput(f"endpoint {endpoint}: folder {folder} does not exist")
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not host:
            raise InvalidInput(f"endpoint {endpoint}: expected tcp://HOST:PORT")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidInput(f"endpoint {endpoint}: port must be a number in 1..65535")
        return endpoint
    raise InvalidInput(
        f"endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)"
    )


def remote_source(
    index: str | os.PathLike, plan: ParallelPlan | str | os.PathLike, *, on_error: str = "skip"
) -> IndexSource:
    """The source a remote worker packs: built exactly as ``make_config`` builds the service's."""
    plan_json = _plan_json(plan)
    path = Path(index).resolve()
    if not path.is_file():
        raise InvalidInput(f"index file {path} does not exist")
    model = json.loads(plan_json).get("model") or None
    source = IndexSource(
        str(path), plan_json, on_error=on_error, options={"model": model} if model else {}
    )
    _check_packer(source)
    return source


def _check_packer(source: SampleSource) -> None:
    """Build one packer here, before any worker: a bad configuration is one clear error."""
    try:
        source.make_packer()
    except EntrainError:
        raise
    except Exception as exc:
        raise InvalidInput(f"the packer cannot be built: {type(exc).__name__}: {exc}") from exc


def make_config(
    *,
    plan: ParallelPlan | str | os.PathLike,
    index: str | os.PathLike | None = None,
    source: SampleSource | None = None,
    endpoint: str | None = None,
    workers: int = 2,
    seed: int = 0,
    epochs: int = 1,
    on_error: str = "skip",
    skipped_path: str | os.PathLike | None = None,
    max_skipped: str | int | None = "1%",
    packer_factory: Any = None,
    table_costs: Any = None,
    curve_secret_key: bytes | None = None,
    curve_public_key: bytes | None = None,
    window: int = 4,
    log_level: int | None = None,
    stats_interval: float = 0.0,
    socket_dir: str | None = None,
    assign_fn: Any = None,
    check_packer: bool = True,
    ranks: str | tuple[int, int] | None = None,
    remote_endpoint: str | None = None,
    remote_timeout: float = 30.0,
) -> ServiceConfig:
    """Validate the options and build a :class:`ServiceConfig` (ipc endpoints in ``socket_dir``).

    What is served is ``index`` (an index file), or a :class:`SampleSource`, or
    ``packer_factory`` + ``table_costs`` (a :class:`CustomSource`). Unless
    ``check_packer`` is false one packer is built here, so a configuration no worker
    could start with fails now, in the caller, with one clear error.
    """
    if on_error not in ("raise", "skip"):
        raise InvalidInput(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if workers < 1:
        raise InvalidInput(f"workers must be >= 1, got {workers}")
    if epochs < 1:
        raise InvalidInput(f"epochs must be >= 1, got {epochs}")
    if window < 1:
        raise InvalidInput(f"window must be >= 1, got {window}")
    parse_budget(max_skipped)
    plan_json = _plan_json(plan)
    served = parse_ranks(ranks, ParallelPlan.from_json(plan_json).world_size)
    if endpoint is not None:
        check_endpoint(endpoint)
    if remote_endpoint is not None and not check_endpoint(remote_endpoint).startswith("tcp://"):
        raise InvalidInput(f"remote workers join over tcp://HOST:PORT, got {remote_endpoint}")
    if index is not None:
        index = str(Path(index).resolve())
        if not Path(index).is_file():
            raise InvalidInput(f"index file {index} does not exist")
        ParallelPlan.from_json(plan_json).model_spec()  # an index is priced with the plan's model
        model = json.loads(plan_json).get("model") or None
        source = IndexSource(
            index, plan_json, on_error=on_error, options={"model": model} if model else {}
        )
    elif source is None and packer_factory is not None and table_costs is not None:
        source = CustomSource(packer_factory, table_costs)
    if source is None:
        raise InvalidInput("give an index, a source, or both packer_factory and table_costs")
    if check_packer:
        _check_packer(source)
    own = socket_dir is None or not os.path.isdir(socket_dir)  # made here: removed at stop
    eps = [endpoint] if endpoint else []
    if not own:  # a folder that exists may hold a live service's sockets
        eps += [f"ipc://{socket_dir}/service.sock", f"ipc://{socket_dir}/workers.sock"]
    for ep in eps:
        taken = _ipc_taken(ep) if ep.startswith("ipc://") else None
        if taken is not None:
            raise taken
    socket_dir = socket_dir or _socket_dir()
    os.makedirs(socket_dir, exist_ok=True)
    endpoint = endpoint or f"ipc://{socket_dir}/service.sock"
    if endpoint.startswith("tcp://") and curve_secret_key is None:
        host = endpoint[6:].rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "[::1]"):
            log.warning(
                "serving %s without CURVE keys: anyone who can reach it can read the data", endpoint
            )
    return ServiceConfig(
        plan_json=plan_json,
        endpoint=endpoint,
        worker_endpoint=f"ipc://{socket_dir}/workers.sock",
        own_dir=socket_dir if own else None,
        source=source,
        workers=workers,
        seed=seed,
        epochs=epochs,
        window=window,
        curve_secret_key=curve_secret_key,
        curve_public_key=curve_public_key,
        skipped_path=str(skipped_path) if skipped_path else None,
        max_skipped=max_skipped,
        log_level=log_level if log_level is not None else logging.getLogger().getEffectiveLevel(),
        stats_interval=stats_interval,
        assign_fn=assign_fn,
        ranks=served,
        remote_endpoint=remote_endpoint,
        remote_timeout=remote_timeout,
    )


_IPC_MAX = 100  # bytes of a socket path, under the 107 of sockaddr_un with room to spare
_IPC_PREFIX = "entrain-ipc-"


def _socket_dir() -> str:
    """A new folder for the service's ipc sockets: in the temp dir, or in /tmp where the temp
    dir's path is too long for a socket (a Kubernetes emptyDir ``TMPDIR``). The process that
    makes it and the coordinator hold it (:mod:`entrain_data.owned_dirs`): what a service
    killed with SIGKILL leaves, the next one removes."""
    d = make_owned_dir(tempfile.gettempdir(), _IPC_PREFIX)
    if len(f"{d}/workers.sock".encode()) > _IPC_MAX and os.path.isdir("/tmp"):
        drop_owned_dir(d)
        d = make_owned_dir("/tmp", _IPC_PREFIX)
    return d


def _ipc_taken(ep: str) -> InvalidInput | None:
    """Why the ipc endpoint ``ep``'s socket file cannot be bound, or None: another process
    listens on it (:class:`AddressInUse`: binding over it would take the path from that
    service, whose stop would then unlink ours), or it is a file of the user's (a bind would
    replace it)."""
    path = ep[len("ipc://") :]
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return InvalidInput(f"endpoint {ep}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return AddressInUse(f"endpoint {ep}: is in use: another service listens there", endpoint=ep)
    except OSError:  # refused: a stale file of a service that is gone
        return None
    finally:
        probe.close()


def remove_ipc(cfg: ServiceConfig) -> None:
    """Unlink the service's ipc sockets, and remove the folder it made for them (only that:
    a user's ``--endpoint`` or ``socket_dir`` folder holds their own files)."""
    for ep in (cfg.endpoint, cfg.worker_endpoint):
        ipc_claim.remove_unclaimed(ep)  # never a successor's: a new service may claim the path
    if cfg.own_dir:
        drop_owned_dir(cfg.own_dir)


def serve_foreground(
    cfg: ServiceConfig, on_stats: Any = None, on_ready: Any = None
) -> dict[str, Any]:
    """Run the coordinator in this process until done, SIGINT or SIGTERM; returns final stats.

    ``on_ready()`` is called once the endpoints are bound and the workers started.
    """
    try:
        coord = Coordinator(cfg, on_stats=on_stats, on_ready=on_ready)
        coord.run(install_signals=True)
    finally:
        remove_ipc(cfg)
    return coord.stats()


def _coordinator_main(cfg: ServiceConfig, reason: Any, held: Any = None) -> None:
    """The service process: run, and on failure hand the typed error to the parent's handle.

    ``held``: the socket folder, whose lock came with this process (``hold_in_child``)."""
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if cfg.own_dir:  # ours too, already (the lock came with us): the parent may end first
        hold_owned_dir(cfg.own_dir)
    try:
        Coordinator(cfg).run(install_signals=True)
    except Exception as exc:
        log.error("loader service stopped: %s", exc)
        with contextlib.suppress(OSError):
            reason.send_bytes(json.dumps(error_fields(exc)).encode())
        raise SystemExit(1) from exc
    finally:
        reason.close()
        remove_ipc(cfg)


def _stop(process: Any, cfg: ServiceConfig, timeout: float) -> None:
    if process.is_alive():
        os.kill(process.pid, signal.SIGTERM)  # the coordinator drains and stops its workers
    stop_processes([process], timeout)
    remove_ipc(cfg)
    if process.pid is not None:  # what a coordinator killed with SIGKILL left in /dev/shm
        remove_shared_dirs(pid=process.pid)


class ServiceHandle:
    """A running loader service started by :func:`start_service`; ``close()`` stops it."""

    def __init__(self, cfg: ServiceConfig, process: Any, reason: Any = None) -> None:
        self.config = cfg
        self.process = process
        self._reason = reason  # the read end of the pipe the service writes its failure to
        self._failure: EntrainError | None = None
        self._finalizer = weakref.finalize(self, _stop, process, cfg, 12.0)

    @property
    def endpoint(self) -> str:
        return self.config.endpoint

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def failure(self) -> EntrainError | None:
        """Why the service stopped, typed as it was raised there (``None``: no failure known)."""
        if self._failure is None and self._reason is not None:
            with contextlib.suppress(OSError, EOFError, ValueError):
                if self._reason.poll(0.2):
                    self._failure = error_from_fields(json.loads(self._reason.recv_bytes()))
        return self._failure

    def state_dict(self) -> dict[str, Any]:
        """What a restarted service needs to reproduce this stream: seed, plan fingerprint, epochs."""
        plan = ParallelPlan.from_json(self.config.plan_json)
        return {
            "seed": self.config.seed,
            "fingerprint": plan.fingerprint(),
            "epochs": self.config.epochs,
        }

    def wait(self, timeout: float) -> int:
        """Wait for the service to end by itself (all epochs served); returns its exit code."""
        self.process.join(timeout)
        if self.process.is_alive():
            raise EntrainTimeout(
                f"loader service at {self.endpoint} still running after {timeout}s"
            )
        return int(self.process.exitcode)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ServiceHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_service(**options: Any) -> ServiceHandle:
    """Spawn a coordinator (and its workers) for ``options`` (see :func:`make_config`).

    The coordinator holds the socket folder from its spawn on, before this returns: this
    process killed at any point after cannot leave the folder to the next service's sweep."""
    cfg = make_config(**options)
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    held = hold_in_child(cfg.own_dir) if cfg.own_dir else None
    p = ctx.Process(target=_coordinator_main, args=(cfg, writer, held), name="entrain-coordinator")
    try:
        p.start()
    except BaseException:
        # e.g. spawn refusing a script without ``if __name__ == "__main__":``: the
        # ipc directory make_config created would otherwise stay behind
        remove_ipc(cfg)
        raise
    finally:
        writer.close()
    return ServiceHandle(cfg, p, reader)


def start_for_dataset(
    dataloader_or_dataset: Any,
    cost_fn: Any = None,
    *,
    plan: Any = None,
    workers: int | None = None,
    **options: Any,
) -> ServiceHandle:
    """Serve a user's torch ``Dataset`` (or a ``DataLoader``'s dataset, collate and workers).

    What ``EntrainLoader.wrap`` runs: checks, profiling and the plan are
    :func:`.wrap_dataset.prepare_wrap`'s (no index or plan file needed).
    """
    from .wrap_dataset import prepare_wrap

    spec = prepare_wrap(dataloader_or_dataset, cost_fn, plan=plan, workers=workers, **options)
    return start_service(plan=spec.plan, workers=spec.workers, source=spec.source, **spec.options)
