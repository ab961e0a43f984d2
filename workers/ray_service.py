"""A node's loader service and its extra workers as Ray actors (``pip install entrain-data[ray]``).

Ray places the processes; the service's own machinery does the rest. The service
actor runs the coordinator (pinned where the caller's ``service_resources`` say,
e.g. beside the GPUs) and accepts remote workers over tcp with CURVE; each worker
actor runs :func:`~.worker.run_remote_worker` wherever Ray finds a free CPU. A
worker actor that dies is restarted by Ray and joins again; the tasks it held are
re-issued once it falls silent, so nothing is lost. :meth:`RayService.close` stops
the coordinator (which stops every worker) and kills the actors.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["RayService", "start_on_ray"]

log = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _ServiceActor:
    """Runs a coordinator in a thread of this actor; its local workers are its children."""

    def __init__(self, options: dict[str, Any], host: str) -> None:
        import zmq

        from .coordinator import Coordinator
        from .service import make_config

        pub, sec = zmq.curve_keypair()
        self.public_key = pub
        options = {
            "endpoint": f"tcp://{host}:{_free_port(host)}",
            "remote_endpoint": f"tcp://{host}:{_free_port(host)}",
            **options,
        }
        self.cfg = make_config(curve_public_key=pub, curve_secret_key=sec, **options)
        self.coordinator = Coordinator(self.cfg)
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="entrain-coordinator", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from .service import remove_ipc

        try:
            self.coordinator.run(install_signals=False)  # signals belong to Ray's main thread
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            remove_ipc(self.cfg)  # the workers' ipc socket and its temp dir

    def endpoints(self) -> tuple[str, str, bytes]:
        return self.cfg.endpoint, str(self.cfg.remote_endpoint), self.public_key

    def wait(self, timeout: float) -> str | None:
        """``None`` while serving; ``"done"`` or the error once the coordinator stopped."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            return None
        return self.error or "done"

    def stop(self) -> None:
        self.coordinator.request_stop()
        self.thread.join(30)


class _WorkerActor:
    """A remote worker: joins the service and packs tasks until the service says stop."""

    def __init__(self, remote_endpoint: str, index: str, plan: str, key: bytes) -> None:
        from .service import remote_source
        from .worker import run_remote_worker

        source = remote_source(index, plan)
        self.thread = threading.Thread(
            target=run_remote_worker,
            args=(remote_endpoint, source),
            kwargs={"curve_server_key": key},
            name="entrain-remote-worker",
            daemon=True,
        )
        self.thread.start()

    def pid(self) -> int:
        return os.getpid()

    def running(self) -> bool:
        return self.thread.is_alive()


@dataclass
class RayService:
    """Handles of one node's service actor and its worker actors."""

    endpoint: str
    remote_endpoint: str
    curve_public_key: bytes
    service: Any
    workers: list[Any]

    def wait(self, timeout: float) -> str | None:
        """``None`` while serving, ``"done"`` when every epoch was served, else the error."""
        import ray

        return ray.get(self.service.wait.remote(timeout))

    def close(self) -> None:
        import ray

        try:
            ray.get(self.service.stop.remote(), timeout=60)
        finally:
            for actor in [self.service, *self.workers]:
                ray.kill(actor, no_restart=True)


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
    **service_options: Any,
) -> RayService:
    """Start one node's service (with ``local_workers``) and ``workers`` worker actors.

    ``index`` and ``plan`` are paths every actor can read (a shared filesystem);
    ``service_resources`` pin the service actor (e.g. ``{"resources": {"node:10.0.0.7":
    0.01}}`` beside its GPUs), ``worker_resources`` the workers (default one CPU each).
    Ranks connect with ``EntrainLoader(svc.endpoint, rank, curve_server_key=
    svc.curve_public_key)``.
    """
    import ray

    index, plan = os.path.abspath(index), os.path.abspath(plan)
    service_cls = ray.remote(_ServiceActor).options(num_cpus=0, **(service_resources or {}))
    service = service_cls.remote(
        {
            "index": index,
            "plan": plan,
            "workers": local_workers,
            "remote_timeout": remote_timeout,
            **service_options,
        },
        host,
    )
    endpoint, remote, key = ray.get(service.endpoints.remote())
    worker_cls = ray.remote(_WorkerActor).options(
        max_restarts=-1, **({"num_cpus": 1} | (worker_resources or {}))
    )
    actors = [worker_cls.remote(remote, index, plan, key) for _ in range(workers)]
    return RayService(endpoint, remote, key, service, actors)
