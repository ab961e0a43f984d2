"""Pipeline simulator against closed forms and hand-checked schedules."""

from __future__ import annotations

import numpy as np
import pytest

from entrain_data.errors import InvalidInput
from entrain_data.simulator import (
    ideal_iteration_time,
    ideal_times,
    lower_bound,
    schedule_order,
    set_loads,
    simulate_pipeline,
)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("m", "s"), [(1, 1), (5, 1), (1, 4), (4, 4), (8, 4), (16, 8), (3, 6)])
def test_equal_microbatches_match_closed_form(schedule, m, s):
    f, b = 1.5, 2.5
    fwd = np.full((2, m, s), f)
    bwd = np.full((2, m, s), b)
    res = simulate_pipeline(fwd, bwd, schedule)
    assert res.iteration_time == pytest.approx((m + s - 1) * (f + b))
    assert np.allclose(res.replica_times, res.iteration_time)


def test_single_stage_is_the_sum():
    rng = np.random.default_rng(0)
    fwd, bwd = rng.random((3, 7, 1)), rng.random((3, 7, 1))
    res = simulate_pipeline(fwd, bwd)
    assert res.replica_times == pytest.approx((fwd + bwd).sum(axis=(1, 2)))
    assert res.bubble_fraction == pytest.approx(0.0, abs=1e-12)


def test_iteration_time_is_the_slowest_replica():
    fwd = np.ones((3, 4, 2))
    bwd = 2 * np.ones((3, 4, 2))
    fwd[1, 2, 0] = 10.0
    res = simulate_pipeline(fwd, bwd)
    assert int(np.argmax(res.replica_times)) == 1
    assert res.iteration_time == res.replica_times[1] > res.replica_times[0]


def test_one_slow_microbatch_two_stages_by_hand():
    # 1F1B, S=2, M=2; stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1
    fwd = np.array([[[1.0, 1.0], [3.0, 1.0]]])  # microbatch 1 slow on stage 0
    bwd = np.array([[[1.0, 1.0], [1.0, 1.0]]])
    # stage0: F0 0-1, F1 1-4; stage1: F0 1-2, B0 2-3, F1 4-5, B1 5-6; stage0: B0 4-5 (after F1), B1 6-7
    assert simulate_pipeline(fwd, bwd).iteration_time == pytest.approx(7.0)


def test_1f1b_order_has_warmup_and_cooldown():
    order = schedule_order("1f1b", 4, 3)
    assert order[0][:3] == ((0, 0), (0, 1), (0, 2))  # S-1-s = 2 warm-up forwards, then F3
    assert order[2][:2] == ((0, 0), (1, 0))  # last stage alternates at once
    for ops in order:
        assert sorted(ops) == sorted([(0, j) for j in range(4)] + [(1, j) for j in range(4)])


def test_unbalanced_is_slower_than_its_ideal():
    rng = np.random.default_rng(1)
    fwd = rng.lognormal(0, 1, (2, 8, 4))
    bwd = 2 * fwd
    mf, mb = ideal_times(fwd, bwd)
    assert simulate_pipeline(fwd, bwd).iteration_time > simulate_pipeline(mf, mb).iteration_time


def test_set_loads_sums_members():
    sets = [[np.array([0, 2]), np.array([1])], [np.array([3]), np.array([], dtype=np.int64)]]
    per = np.array([1.0, 2.0, 3.0, 4.0])
    assert set_loads(sets, per).tolist() == [[4.0, 2.0], [4.0, 0.0]]
    two = set_loads(sets, np.stack([per, 10 * per], axis=1))
    assert two[0, 0].tolist() == [4.0, 40.0]


@pytest.mark.parametrize(
    "fwd, bwd",
    [
        (np.ones((2, 3)), np.ones((2, 3))),
        (np.ones((1, 2, 3)), np.ones((1, 2, 2))),
        (-np.ones((1, 2, 3)), np.ones((1, 2, 3))),
        (np.full((1, 2, 3), np.nan), np.ones((1, 2, 3))),
    ],
)
def test_bad_input_is_rejected(fwd, bwd):
    with pytest.raises(InvalidInput):
        simulate_pipeline(fwd, bwd)


def test_unknown_schedule():
    with pytest.raises(InvalidInput, match="schedule"):
        simulate_pipeline(np.ones((1, 1, 1)), np.ones((1, 1, 1)), "zb")


def test_ideal_and_lower_bound_closed_forms():
    rng = np.random.default_rng(2)
    r, m, s = 3, 6, 4
    fwd = rng.random((r, m, s)) + 0.1
    bwd = 2 * fwd
    mf = fwd.mean(axis=(0, 1))
    mb = bwd.mean(axis=(0, 1))
    # equal microbatches, stages differing: GPipe is two flow shops of identical jobs,
    # each sum over stages + (M - 1) x the slowest stage
    uniform = np.ones((1, m, s)) * mf
    expect = mf.sum() + (m - 1) * mf.max() + mb.sum() + (m - 1) * mb.max()
    assert simulate_pipeline(uniform, 2 * uniform, "gpipe").iteration_time == pytest.approx(expect)
    assert ideal_iteration_time(fwd, bwd, "gpipe") == pytest.approx(expect)
    one_f_one_b = simulate_pipeline(uniform, 2 * uniform).iteration_time
    assert ideal_iteration_time(fwd, bwd) == pytest.approx(one_f_one_b)
    # 1F1B cannot beat the slowest stage's busy time nor one microbatch's round trip
    assert one_f_one_b >= max(m * (mf + mb).max(), (mf + mb).sum()) - 1e-9
    lb = lower_bound(fwd, bwd)
    assert lb == pytest.approx((fwd + bwd).sum(axis=1).mean(axis=0).max())
    assert lb <= ideal_iteration_time(fwd, bwd) <= simulate_pipeline(fwd, bwd).iteration_time


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_replica_is_simulated_alone(schedule):
    # the one-replica path (plain floats) and the vectorised path agree replica by replica
    rng = np.random.default_rng(3)
    fwd = rng.lognormal(0, 0.5, (4, 9, 5))
    bwd = rng.lognormal(0.5, 0.5, (4, 9, 5))
    res = simulate_pipeline(fwd, bwd, schedule)
    alone = [
        simulate_pipeline(fwd[r : r + 1], bwd[r : r + 1], schedule).iteration_time for r in range(4)
    ]
    assert res.replica_times == pytest.approx(alone)
    assert res.iteration_time == pytest.approx(max(alone))
