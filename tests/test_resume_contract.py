"""The one resume contract every stateful object passes (as torchdata's nodes do).

Run N steps, save ``state_dict()`` (through JSON, as a checkpoint would), restore it into a
*fresh* object, and the continuation equals the uninterrupted run. Each stateful object of
the service side is a case: the loader (a rank's client), and the loader together with the
service it talks to (``ServiceHandle.state_dict()`` restarts an equal service).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from test_service import make_plan, make_shards, start

from entrain_data.client import EntrainLoader

pytestmark = pytest.mark.timeout(240)


def check_resume_contract(
    fresh: Callable[[], Any], step: Callable[[Any], Any], n: int, total: int
) -> None:
    """``fresh()`` builds the object, ``step(obj)`` advances it once and returns what it gave."""
    ref = fresh()
    try:
        whole = [step(ref) for _ in range(total)]
    finally:
        ref.close()
    first = fresh()
    try:
        head = [step(first) for _ in range(n)]
        state = json.loads(json.dumps(first.state_dict()))
    finally:
        first.close()
    again = fresh()
    try:
        again.load_state_dict(state)
        rest = [step(again) for _ in range(total - n)]
    finally:
        again.close()
    assert head + rest == whole


class _Rank:
    """A rank's loop over epochs: the loader, plus the iterator the training loop holds."""

    def __init__(self, endpoint: str, rank: int) -> None:
        self.loader = EntrainLoader(endpoint, rank, prefetch=2, timeout=60)
        self._it: Any = None

    def step(self) -> tuple:
        while True:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                m = next(self._it)
                return (m.epoch, m.iteration, m.microbatch, m.encoder_keys, m.llm_keys)
            except StopIteration:
                self._it = None

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()


def test_the_loader_passes_the_resume_contract(tmp_path):
    """Across an epoch boundary: 12 microbatches an epoch, stop at 10, run to 17."""
    svc = start(tmp_path, make_shards(tmp_path), make_plan(dp=1), seed=3, epochs=2)
    try:
        check_resume_contract(lambda: _Rank(svc.endpoint, 0), _Rank.step, n=10, total=17)
    finally:
        svc.close()


class _ServedRank:
    """A rank and the service it talks to, saved and restored together (a whole job restart)."""

    def __init__(self, tmp_path, index) -> None:
        self.tmp_path, self.index = tmp_path, index
        self.svc = start(tmp_path, index, make_plan(dp=1), seed=7, epochs=2)
        self.rank = _Rank(self.svc.endpoint, 0)

    def step(self) -> tuple:
        return self.rank.step()

    def state_dict(self) -> dict:
        return {"service": self.svc.state_dict(), "loader": self.rank.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rank.close()
        self.svc.close()
        s = state["service"]
        self.svc = start(
            self.tmp_path, self.index, make_plan(dp=1), seed=s["seed"], epochs=s["epochs"]
        )
        assert self.svc.state_dict() == s
        self.rank = _Rank(self.svc.endpoint, 0)
        self.rank.load_state_dict(state["loader"])

    def close(self) -> None:
        self.rank.close()
        self.svc.close()


@pytest.mark.slow
def test_the_service_and_loader_together_pass_the_resume_contract(tmp_path):
    index = make_shards(tmp_path)
    check_resume_contract(lambda: _ServedRank(tmp_path, index), _ServedRank.step, n=5, total=14)
