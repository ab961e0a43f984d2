"""A node's loader service and its extra workers as Ray actors (``pip install entrain-data[ray]``).

Ray places the processes; the service's own machinery does the rest. The service
actor runs the coordinator (pinned where the caller's ``service_resources`` say,
e.g. beside the GPUs) and accepts remote workers over tcp with CURVE; each worker
actor runs :func:`~.worker.run_remote_worker` wherever Ray finds a free CPU. A
worker actor that dies is restarted by Ray and joins again; the tasks it held are
re-issued once it falls silent, so nothing is lost. :meth:`RayService.close` stops
the coordinator (which stops every worker) and kills the actors.

An actor that cannot start keeps its error, typed (:func:`~entrain_data.errors.error_fields`),
instead of raising it from ``__init__``: Ray would bury it in an ``ActorDiedError`` and,
for a worker, never restart it, unseen. :func:`start_on_ray` returns only once the service
serves (its sockets bound) and raises what stopped it; :meth:`RayService.wait` also reports
a worker actor that cannot work.

The service actor picks its tcp ports itself (they must be free on its node, not the caller's).
A port is free when picked but bound only later by the coordinator, so another process may take
it in between: the actor then picks afresh, up to ``_PORT_TRIES`` times. (Binding port 0 and
reading back the port would close that window, but the coordinator binds the endpoints its
config names and reports those.)
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any

from entrain_data.errors import (
    AddressInUse,
    EntrainError,
    EntrainTimeout,
    InvalidInput,
    error_fields,
    error_from_fields,
)

__all__ = ["RayService", "start_on_ray"]

log = logging.getLogger(__name__)

_STEP_S = 2.0  # RayService.wait looks at the workers this often
_CALL_S = 30.0  # a quick actor call (status, stop's own join aside) answers within this
_STOP_S = 30.0  # the coordinator's drain, then the actors are killed regardless
_WORKERS_START_S = 30.0  # start_on_ray waits this long for worker actors Ray could place
_CONCURRENCY = 4  # the service actor's calls run in threads: close() never queues behind wait()
_MADE_HERE = ("curve_public_key", "curve_secret_key")  # the service actor makes its own keys
_PICKED = ("endpoint", "remote_endpoint")  # tcp endpoints the actor picks unless given
_PORT_TRIES = 5  # picks of fresh ports before a service whose ports keep being taken fails

PortPicker = Callable[[str], int]


def _free_port(host: str) -> int:
    """A port free on ``host`` now (the kernel's pick); raises ``OSError`` for a host that is
    not an address of this node or does not resolve."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pick_endpoints(host: str, names: list[str], pick: PortPicker) -> dict[str, str]:
    """``tcp://host:PORT`` for each of ``names``; a bad host is the caller's ``InvalidInput``."""
    try:
        return {name: f"tcp://{host}:{pick(host)}" for name in names}
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise InvalidInput(
            f"host {host!r}: the loader service cannot bind there on node "
            f"{socket.gethostname()}: {why}"
        ) from None


def _taken(exc: BaseException, picked: dict[str, str]) -> str | None:
    """The picked endpoint whose bind failed as taken (``open_sockets``'s ``AddressInUse``), or
    None: a port the caller named is never re-picked."""
    if isinstance(exc, AddressInUse) and exc.endpoint in picked.values():
        return exc.endpoint
    return None


def _failure(exc: BaseException) -> dict[str, Any]:
    """The typed error's fields, and the one line :meth:`RayService.wait` reports."""
    return {"fields": error_fields(exc), "line": f"{type(exc).__name__}: {exc}"}


class _ServiceActor:
    """Runs a coordinator in a thread of this actor; its local workers are its children."""

    def __init__(self, options: dict[str, Any], host: str, pick: PortPicker = _free_port) -> None:
        import zmq

        from .coordinator import Coordinator
        from .service import make_config, remove_ipc

        self.failure: dict[str, Any] | None = None
        self.thread: threading.Thread | None = None
        self.serving = threading.Event()  # set by the coordinator once bound and serving
        self.stopping = False
        self.lock = threading.Lock()  # stop() and a re-pick's new coordinator: one at a time
        self.host, self.pick = host, pick
        self.public_key, sec = zmq.curve_keypair()
        self.picked: dict[str, str] = {}  # the endpoints picked here, by option name
        self.cfg: Any = None  # the ServiceConfig, once make_config accepts the options
        try:  # a bad host too fails typed here, not as Ray's ActorDiedError
            self.picked = _pick_endpoints(host, [n for n in _PICKED if n not in options], pick)
            self.cfg = make_config(
                curve_public_key=self.public_key, curve_secret_key=sec, **self.picked, **options
            )
            self.coordinator = Coordinator(self.cfg, on_ready=self.serving.set)
        except Exception as exc:  # kept for ready(): the driver raises it, typed
            self.failure = _failure(exc)
            if self.cfg is not None:
                remove_ipc(self.cfg)  # the socket folder make_config made
            return
        self.thread = threading.Thread(target=self._run, name="entrain-coordinator", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from .service import remove_ipc

        try:
            taken: list[str] = []  # the picked ports another process bound first
            while True:
                try:
                    self.coordinator.run(install_signals=False)  # signals: Ray's main thread's
                    return
                except AddressInUse as exc:
                    ep = _taken(exc, self.picked)
                    if ep is None:
                        raise
                    taken.append(ep.rpartition(":")[2])
                    if len(taken) >= _PORT_TRIES:
                        raise AddressInUse(
                            f"cannot serve on {self.host}: ports {', '.join(taken)} were each "
                            f"taken by another process before the service bound them "
                            f"({_PORT_TRIES} tries): address already in use"
                        ) from None
                    log.info("%s was taken before the service bound it: picking again", ep)
                    if not self._repick():
                        return  # stop() came first
        except Exception as exc:
            self.failure = _failure(exc)
        finally:
            remove_ipc(self.cfg)  # the workers' ipc socket and its temp dir

    def _repick(self) -> bool:
        """A new coordinator on fresh ports (its config as before otherwise); ``False`` once
        stop() was asked: the lock keeps stop() from asking a coordinator about to be replaced."""
        from .coordinator import Coordinator

        with self.lock:
            if self.stopping:
                return False
            self.picked = _pick_endpoints(self.host, list(self.picked), self.pick)
            self.cfg = dc_replace(self.cfg, **self.picked)
            self.coordinator = Coordinator(self.cfg, on_ready=self.serving.set)
            return True

    def ready(self, timeout: float) -> dict[str, Any]:
        """Once serving, the endpoints; else ``{"failure": ...}`` or, still starting, ``{}``."""
        deadline = time.monotonic() + timeout
        while self.thread is not None and self.thread.is_alive() and not self.serving.is_set():
            if time.monotonic() > deadline:
                return {}
            self.serving.wait(0.1)
        if self.failure is not None:
            return {"failure": self.failure["fields"]}
        if not self.serving.is_set():  # stopped before it served: only stop() does that
            return {"failure": error_fields(EntrainError("stopped before it served"))}
        cfg = self.cfg
        return {"endpoints": (cfg.endpoint, str(cfg.remote_endpoint), self.public_key)}

    def pid(self) -> int:
        return os.getpid()

    def wait(self, timeout: float) -> str | None:
        """``None`` while serving; ``"done"``, ``"stopped"`` or the error once it stopped."""
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                return None
        if self.failure is not None:
            return self.failure["line"]
        return "stopped" if self.stopping else "done"

    def stop(self, timeout: float) -> bool:
        """Drain the coordinator (it stops its workers, removes its ipc and shared-memory
        files); ``False`` if it still runs after ``timeout``."""
        if self.thread is None:
            return True
        with self.lock:
            if self.thread.is_alive():
                self.stopping = True
            self.coordinator.request_stop()
        self.thread.join(timeout)
        return not self.thread.is_alive()


class _WorkerActor:
    """A remote worker: joins the service and packs tasks until the service says stop."""

    def __init__(self, remote_endpoint: str, index: str, plan: str, key: bytes) -> None:
        from .service import remote_source

        self.failure: dict[str, Any] | None = None
        self.thread: threading.Thread | None = None
        try:  # e.g. the index missing on this host: kept, since Ray never restarts a failed init
            source = remote_source(index, plan)
        except Exception as exc:
            self.failure = _failure(exc)
            return
        self.thread = threading.Thread(
            target=self._run,
            args=(remote_endpoint, source, key),
            name="entrain-remote-worker",
            daemon=True,
        )
        self.thread.start()

    def _run(self, remote_endpoint: str, source: Any, key: bytes) -> None:
        from .worker import run_remote_worker

        try:
            run_remote_worker(remote_endpoint, source, curve_server_key=key)
        except Exception as exc:  # refused by the service, or the service fell silent
            self.failure = _failure(exc)

    def pid(self) -> int:
        return os.getpid()

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def status(self) -> dict[str, Any]:
        """This worker's host and, once it cannot work, its failure."""
        return {"host": socket.gethostname(), "failure": self.failure}


def _worker_failures(workers: list[Any], timeout: float) -> list[tuple[int, str, EntrainError]]:
    """``(index, line, typed error)`` of the worker actors that cannot work.

    One still placed or restarted by Ray is not a failure; one Ray gave up on is.
    """
    import ray

    if not workers:
        return []
    refs = [w.status.remote() for w in workers]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out = []
    for i, ref in enumerate(refs):
        if ref not in done:
            continue  # waiting for a CPU: not started yet
        try:
            status = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:
            continue  # restarting
        except ray.exceptions.RayActorError as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            out.append((i, f"worker actor {i} died: {why}", EntrainError(why)))
            continue
        if status["failure"] is not None:
            prefix = f"worker actor {i} on {status['host']}: "
            typed = error_from_fields(status["failure"]["fields"], prefix=prefix)
            out.append((i, prefix + status["failure"]["line"], typed))
    return out


@dataclass
class RayService:
    """Handles of one node's service actor and its worker actors."""

    endpoint: str
    remote_endpoint: str
    curve_public_key: bytes
    service: Any
    workers: list[Any]
    _closed: bool = field(default=False, init=False, repr=False)

    def wait(self, timeout: float) -> str | None:
        """``None`` while serving, ``"done"`` when every epoch was served, ``"stopped"`` after
        :meth:`close`, else the error: the service's, or that of a worker actor that cannot
        work (Ray restarts a worker whose process died, not one that failed by itself)."""
        import ray

        deadline = time.monotonic() + timeout
        while not self._closed:
            step = max(0.0, min(_STEP_S, deadline - time.monotonic()))
            try:
                state = ray.get(self.service.wait.remote(step), timeout=step + _CALL_S)
            except ray.exceptions.RayActorError as exc:
                return "stopped" if self._closed else f"the service actor died: {exc}"
            except ray.exceptions.GetTimeoutError:
                state = None  # an actor busy past _CALL_S: still there
            if state is not None:  # the service's end comes before what its workers say
                return "stopped" if self._closed else state
            failed = _worker_failures(self.workers, timeout=1.0)
            if failed and not self._closed:  # close() kills them: not a failure
                return failed[0][1]
            if time.monotonic() >= deadline:
                return None
        return "stopped"

    def close(self) -> None:
        """Stop the coordinator (its cleanup runs: shared memory, ipc folder, local workers),
        then kill the actors; a coordinator still draining after ``_STOP_S`` is killed."""
        import ray

        if self._closed:
            return
        self._closed = True
        try:
            if not ray.get(self.service.stop.remote(_STOP_S), timeout=_STOP_S + _CALL_S):
                log.warning("the loader service did not stop in %ss: killing it", _STOP_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            log.warning("the service actor did not stop cleanly: %s", exc)
        finally:
            for actor in [self.service, *self.workers]:
                ray.kill(actor, no_restart=True)


def _check_options(options: dict[str, Any]) -> None:
    """Names ``make_config`` does not take fail here, as ``TypeError``, not inside an actor."""
    from .service import make_config

    known = set(inspect.signature(make_config).parameters) - set(_MADE_HERE)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"start_on_ray() got unknown service options: {', '.join(unknown)}")


def start_on_ray(
    *,
    index: str,
    plan: str,
    workers: int = 2,
    local_workers: int = 1,
    host: str = "127.0.0.1",
    service_resources: dict[str, Any] | None = None,
    worker_resources: dict[str, Any] | None = None,
    remote_timeout: float = 30.0,
    start_timeout: float = 300.0,
    **service_options: Any,
) -> RayService:
    """Start one node's service (with ``local_workers``) and ``workers`` worker actors.

    ``index`` and ``plan`` are paths every actor can read (a shared filesystem);
    ``service_resources`` pin the service actor (e.g. ``{"resources": {"node:10.0.0.7":
    0.01}}`` beside its GPUs), ``worker_resources`` the workers (default one CPU each).
    Ranks connect with ``EntrainLoader(svc.endpoint, rank, curve_server_key=
    svc.curve_public_key)``.

    Returns once the service serves and the worker actors Ray could place at once have
    started (one still waiting for a CPU is reported by :meth:`RayService.wait` if it
    fails later). A port the service picked (``endpoint``, ``remote_endpoint`` not given)
    and another process took before the bind is picked again. Raises, after stopping what it
    started, the typed error (``InvalidInput``: a bad option, a ``host`` the service's node
    cannot bind, a given port taken or picked ports taken on every try, a plan or index a
    worker's host cannot read), ``TypeError`` for an option ``make_config`` does not take, or
    ``EntrainTimeout`` when the service is not serving after ``start_timeout`` seconds.
    """
    import ray

    _check_options(service_options)
    index, plan = os.path.abspath(index), os.path.abspath(plan)
    service_cls = ray.remote(_ServiceActor).options(
        **({"num_cpus": 0, "max_concurrency": _CONCURRENCY} | (service_resources or {}))
    )
    options = {"index": index, "plan": plan, "workers": local_workers}
    options |= {"remote_timeout": remote_timeout, **service_options}
    # the picker travels with the actor (a test may replace it here); it runs on the actor's node
    svc = RayService("", "", b"", service_cls.remote(options, host, _free_port), [])
    try:
        svc.endpoint, svc.remote_endpoint, svc.curve_public_key = _serving(svc, start_timeout)
        worker_cls = ray.remote(_WorkerActor).options(
            max_restarts=-1, **({"num_cpus": 1} | (worker_resources or {}))
        )
        args = (svc.remote_endpoint, index, plan, svc.curve_public_key)
        svc.workers = [worker_cls.remote(*args) for _ in range(workers)]
        failed = _worker_failures(svc.workers, timeout=min(start_timeout, _WORKERS_START_S))
        if failed:
            raise failed[0][2]
    except BaseException:
        svc.close()
        raise
    return svc


def _serving(svc: RayService, timeout: float) -> tuple[str, str, bytes]:
    """The service's endpoints once it serves; raises why it does not."""
    import ray

    try:
        state = ray.get(svc.service.ready.remote(timeout), timeout=timeout + _CALL_S)
    except ray.exceptions.GetTimeoutError:
        state = {}  # not even placed (its service_resources exist nowhere yet)
    if "failure" in state:
        raise error_from_fields(state["failure"])
    if "endpoints" not in state:
        raise EntrainTimeout(f"the loader service actor was not serving after {timeout}s")
    return state["endpoints"]
