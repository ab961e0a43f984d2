"""Exact resume: stop after N microbatches, save client and service state, restart both, continue.

The resume contract every stateful object passes: run N, save, restore into a
fresh object, and the continuation equals the uninterrupted run.
"""

from __future__ import annotations

import json

import pytest
from test_service import close_all, make_plan, make_shards, run_ranks, start

from entrain_data.client import EntrainLoader
from entrain_data.errors import EntrainError

pytestmark = pytest.mark.timeout(180)


def _seq(mbs):
    return [(m.epoch, m.iteration, m.microbatch, m.encoder_keys, m.llm_keys) for m in mbs]


@pytest.mark.slow  # three service starts; the fast variant below restarts only the client
def test_resume_after_restarting_service_and_clients_equals_uninterrupted_run(tmp_path):
    index = make_shards(tmp_path)
    plan = make_plan()
    svc = start(tmp_path, index, plan, seed=11, epochs=2)
    try:
        full, loaders = run_ranks(svc.endpoint, [0, 1])
        full2 = {}
        for ld in loaders:  # the second epoch, through the same loaders
            full2[ld.rank] = list(ld)
        close_all(loaders)
    finally:
        svc.close()
    whole = {r: _seq(full[r]) + _seq(full2[r]) for r in (0, 1)}
    assert all(len(v) == 2 * 12 for v in whole.values())

    # interrupted: 5 microbatches, save, stop everything
    svc = start(tmp_path, index, plan, seed=11, epochs=2)
    try:
        part, loaders = run_ranks(svc.endpoint, [0, 1], limit=5)
        states = {ld.rank: json.loads(json.dumps(ld.state_dict())) for ld in loaders}
        service_state = svc.state_dict()
        close_all(loaders)
    finally:
        svc.close()
    assert states[0]["iteration"] == 1 and states[0]["microbatch"] == 2

    # restart both from the saved state
    svc = start(tmp_path, index, plan, seed=service_state["seed"], epochs=service_state["epochs"])
    try:
        loaders = [EntrainLoader(svc.endpoint, r, prefetch=2, timeout=60) for r in (0, 1)]
        for ld in loaders:
            ld.load_state_dict(states[ld.rank])
        rest = {ld.rank: list(ld) + list(ld) for ld in loaders}
        assert all(list(ld) == [] for ld in loaders)
        close_all(loaders)
    finally:
        svc.close()
    for r in (0, 1):
        assert _seq(part[r]) + _seq(rest[r]) == whole[r]


def test_client_restart_against_the_same_service_and_state_checks(tmp_path):
    index = make_shards(tmp_path)
    svc = start(tmp_path, index, make_plan(), seed=5)
    try:
        ref = EntrainLoader(svc.endpoint, 1, timeout=60)
        expected = _seq(list(ref))
        ref.close()
        ld = EntrainLoader(svc.endpoint, 1, timeout=60)
        it = iter(ld)
        head = [next(it) for _ in range(4)]
        state = ld.state_dict()
        ld.close()  # the rank "crashes"
        again = EntrainLoader(svc.endpoint, 1, timeout=60)
        again.load_state_dict(state)
        assert _seq(head) + _seq(list(again)) == expected
        again.close()
        wrong = EntrainLoader(svc.endpoint, 1, timeout=60)
        wrong.load_state_dict({**state, "seed": 6})
        with pytest.raises(EntrainError, match="seed"):
            list(wrong)
        wrong.close()
        with pytest.raises(ValueError, match="rank"):
            EntrainLoader(svc.endpoint, 0).load_state_dict(state)
    finally:
        svc.close()
