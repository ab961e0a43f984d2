"""The background assignment's cache: a replica far behind the others still gets its rows."""

from __future__ import annotations

import time

import numpy as np
from entrain_data.workers.assign_ahead import AssignAhead
from entrain_data.workers.schedule import Scheduler


def _slot(ahead: AssignAhead, replica: int, pos: int, wait: float = 10.0):
    end = time.monotonic() + wait
    while time.monotonic() < end:
        s = ahead.slot(replica, pos)
        if s is not None:
            return s
        time.sleep(0.002)
    return None


def test_a_replica_many_iterations_behind_gets_its_iteration():
    """Replica 0 reads its whole epoch (24 iterations, more than the cache holds) before
    replica 1 starts: evicting the oldest iteration dropped replica 1's the moment it was
    assigned again, and that rank waited forever."""
    rng = np.random.default_rng(0)
    tok = rng.integers(10, 200, 96)
    sched = Scheduler(np.zeros((96, 1)), tok.astype(float), tok, dp=2, microbatches=2,
                      global_batch=4, max_tokens=1 << 20, defer_budget=1 << 20,
                      method="sequential", seed=0)  # fmt: skip
    ahead = AssignAhead(sched, cache=16)
    try:
        assert sched.shape.per_epoch > 2 * 16  # more iterations than the cache
        for pos in range(sched.shape.per_epoch):
            assert _slot(ahead, 0, pos) is not None
        first = _slot(ahead, 1, 0)
        assert first is not None, "replica 1 never got iteration 0"
        assert _slot(ahead, 1, 1) is not None
        assert len(ahead._done) <= 16
    finally:
        ahead.close()
