"""The service's counters and the stats a rank (or the ``serve`` console) asks for."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counters", "service_stats"]


@dataclass
class Counters:
    """What the coordinator counts while it serves."""

    started: float = field(default_factory=time.monotonic)
    microbatches: int = 0
    samples: int = 0
    bytes: int = 0
    relayed: int = 0  # payload bytes that passed through the coordinator (hop route)
    shared: int = 0  # bytes workers wrote into shared memory, once for all ranks reading them
    tasks_done: int = 0
    tasks_reissued: int = 0
    rejected_messages: int = 0
    skipped: int = 0


def service_stats(coord: Any) -> dict[str, Any]:
    """A plain dict of a coordinator's counters, queues, ranks, assignment latency and workers."""
    c = coord.counters
    lat = list(coord.scheduler.latencies)
    return {
        "state": coord.state.value,
        "uptime_s": round(time.monotonic() - c.started, 3),
        "microbatches_served": c.microbatches,
        "bytes_served": c.bytes,
        "bytes_relayed": c.relayed,
        "bytes_shared_memory": c.shared,
        "samples_served": c.samples,
        "tasks_done": c.tasks_done,
        "tasks_reissued": c.tasks_reissued,
        "rejected_messages": c.rejected_messages,
        "skipped_samples": c.skipped,
        "left_out_samples": coord.record.left_out,
        "queue": {
            "ready": len(coord.production.ready),
            "queued": len(coord.production.queue),
            "in_flight": len(coord.production.in_flight),
        },
        "ranks": {str(r.rank): r.next_pos for r in coord.ranks.values()},
        "direct_ranks": sorted(r.rank for r in coord.ranks.values() if r.data is not None),
        # direct ranks that remote workers still reach over tcp (not fallen back to the hop)
        "remote_direct_ranks": sorted(
            r.rank for r in coord.ranks.values() if r.data is not None and r.remote is not None
        ),
        "assignment_latency_s": {
            "count": len(lat),
            "mean": (sum(lat) / len(lat)) if lat else 0.0,
            "max": max(lat, default=0.0),
        },
        "workers": coord._pool_stats(),
        "stopped_by": coord._stop_reason if coord._stop else None,
    }
