"""Start and stop the loader service: in the foreground (``entrain-data serve``) or as a child.

:func:`start_service` spawns the coordinator (which spawns its workers) and
returns a :class:`ServiceHandle`; the handle's ``close()`` (also a context
manager and a ``weakref.finalize``) stops it with join -> terminate -> kill and
removes the ipc socket files. The coordinator's own lifecycle is the
:class:`~.coordinator.State` machine (starting, serving, draining, stopped).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from entrain_data.errors import EntrainTimeout, InvalidInput
from entrain_data.plan import ParallelPlan

from .coordinator import Coordinator, ServiceConfig
from .worker import IndexPackerFactory, stop_processes

__all__ = ["IndexCosts", "ServiceHandle", "make_config", "serve_foreground", "start_service"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexCosts:
    """Picklable: per-sample costs of an index under a plan's model, computed in the coordinator."""

    index_path: str
    plan_json: str

    def __call__(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from entrain_data.cost_model import per_sample_costs
        from entrain_data.metadata import read_index

        table = read_index(self.index_path)
        plan = ParallelPlan.from_json(self.plan_json)
        costs = per_sample_costs(table, plan.model_spec(), calibration=plan.calibration)
        enc = costs.encoder_cost()
        if enc.shape[1]:
            enc = plan.stage_encoder_cost(enc)  # one column per group of co-located encoders
        return enc, costs.llm_cost(), np.asarray(costs.llm_tokens)


def _plan_json(plan: ParallelPlan | str | os.PathLike) -> str:
    if isinstance(plan, ParallelPlan):
        return plan.to_json()
    return ParallelPlan.load(plan).to_json()


def make_config(
    *,
    plan: ParallelPlan | str | os.PathLike,
    index: str | os.PathLike | None = None,
    endpoint: str | None = None,
    workers: int = 2,
    seed: int = 0,
    epochs: int = 1,
    on_error: str = "raise",
    skipped_path: str | os.PathLike | None = None,
    packer_factory: Any = None,
    table_costs: Any = None,
    curve_secret_key: bytes | None = None,
    curve_public_key: bytes | None = None,
    window: int = 4,
    log_level: int | None = None,
    stats_interval: float = 0.0,
    socket_dir: str | None = None,
) -> ServiceConfig:
    """Validate the options and build a :class:`ServiceConfig` (ipc endpoints in ``socket_dir``)."""
    if on_error not in ("raise", "skip"):
        raise InvalidInput(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if workers < 1:
        raise InvalidInput(f"workers must be >= 1, got {workers}")
    if epochs < 1:
        raise InvalidInput(f"epochs must be >= 1, got {epochs}")
    plan_json = _plan_json(plan)
    if index is not None:
        index = str(Path(index).resolve())
        if not Path(index).is_file():
            raise InvalidInput(f"index file {index} does not exist")
        model = json.loads(plan_json).get("model") or None
        packer_factory = packer_factory or IndexPackerFactory(
            index, on_error=on_error, options={"model": model} if model else {}
        )
        table_costs = table_costs or IndexCosts(index, plan_json)
    if packer_factory is None or table_costs is None:
        raise InvalidInput("give an index, or both packer_factory and table_costs")
    socket_dir = socket_dir or tempfile.mkdtemp(prefix="entrain-")
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
        packer_factory=packer_factory,
        table_costs=table_costs,
        workers=workers,
        seed=seed,
        epochs=epochs,
        window=window,
        curve_secret_key=curve_secret_key,
        curve_public_key=curve_public_key,
        skipped_path=str(skipped_path) if skipped_path else None,
        log_level=log_level if log_level is not None else logging.getLogger().getEffectiveLevel(),
        stats_interval=stats_interval,
    )


def _ipc_dir(cfg: ServiceConfig) -> str | None:
    ep = cfg.worker_endpoint
    return os.path.dirname(ep[len("ipc://") :]) if ep.startswith("ipc://") else None


def _remove_ipc(cfg: ServiceConfig) -> None:
    for ep in (cfg.endpoint, cfg.worker_endpoint):
        if ep.startswith("ipc://"):
            path = ep[len("ipc://") :]
            if os.path.exists(path):
                os.unlink(path)
    d = _ipc_dir(cfg)
    if d and os.path.basename(d).startswith("entrain-") and os.path.isdir(d):
        shutil.rmtree(d, ignore_errors=True)


def serve_foreground(cfg: ServiceConfig, on_stats: Any = None) -> dict[str, Any]:
    """Run the coordinator in this process until done, SIGINT or SIGTERM; returns final stats."""
    coord = Coordinator(cfg, on_stats=on_stats)
    try:
        coord.run(install_signals=True)
    finally:
        _remove_ipc(cfg)
    return coord.stats()


def _coordinator_main(cfg: ServiceConfig) -> None:
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        Coordinator(cfg).run(install_signals=True)
    except Exception as exc:
        log.error("loader service stopped: %s", exc)
        raise SystemExit(1) from exc
    finally:
        _remove_ipc(cfg)


def _stop(process: Any, cfg: ServiceConfig, timeout: float) -> None:
    if process.is_alive():
        os.kill(process.pid, signal.SIGTERM)  # the coordinator drains and stops its workers
    stop_processes([process], timeout)
    _remove_ipc(cfg)


class ServiceHandle:
    """A running loader service started by :func:`start_service`; ``close()`` stops it."""

    def __init__(self, cfg: ServiceConfig, process: Any) -> None:
        self.config = cfg
        self.process = process
        self._finalizer = weakref.finalize(self, _stop, process, cfg, 12.0)

    @property
    def endpoint(self) -> str:
        return self.config.endpoint

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

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
    """Spawn a coordinator (and its workers) for ``options`` (see :func:`make_config`)."""
    cfg = make_config(**options)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_coordinator_main, args=(cfg,), name="entrain-coordinator")
    try:
        p.start()
    except BaseException:
        # e.g. spawn refusing a script without ``if __name__ == "__main__":``: the
        # ipc directory make_config created would otherwise stay behind
        _remove_ipc(cfg)
        raise
    return ServiceHandle(cfg, p)
