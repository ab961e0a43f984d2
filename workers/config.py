"""The service's configuration and lifecycle states: plain values shared by its modules."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .sample_source import SampleSource

__all__ = ["State", "ServiceConfig"]


class State(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ServiceConfig:
    """Everything a coordinator needs; picklable (it crosses a spawn boundary)."""

    plan_json: str
    endpoint: str
    worker_endpoint: str
    source: SampleSource  # costs and keys here, a packer in each worker
    workers: int = 2
    seed: int = 0
    epochs: int = 1
    window: int = 4
    curve_secret_key: bytes | None = None
    curve_public_key: bytes | None = None
    skipped_path: str | None = None
    max_skipped: str | int | None = "1%"  # error budget of undecodable samples (count or "N%")
    max_restarts: int = 20  # worker restarts within pool.RESTART_WINDOW (10 min) before it stops
    assign_fn: Callable[..., Any] | None = None  # replaces assignment.assign (tests)
    ranks: tuple[int, int] | None = None  # inclusive range of ranks this node serves; None: all
    remote_endpoint: str | None = None  # tcp://HOST:PORT where remote workers join (CURVE if keyed)
    remote_timeout: float = 30.0  # seconds without a word before a remote worker is presumed dead
    log_level: int = logging.WARNING
    stats_interval: float = 0.0  # seconds between logged stats lines; 0: never
    own_dir: str | None = None  # the folder made for the ipc sockets: removed at stop
