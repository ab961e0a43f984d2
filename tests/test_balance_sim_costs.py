"""bench/balance.py's ``--sim-cost`` (the simulator's costs off the model the methods assign
on) and ``--mixes`` (mixes of the real corpora).

The perturbations must charge only work that exists (a stage a microbatch or sample does not
use stays free), leave the linear run untouched, and penalise uneven microbatches in the
convex case and nothing else.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def balance():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("balance", BENCH / "balance.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


def _times(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[R, M, S] stage times with a stage some microbatches do not use (text only)."""
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.5, 2.0, (3, 8, 4))
    f[:, ::3, 0] = 0.0
    return f, 2 * f


def test_linear_is_the_cost_model(balance):
    f, b = _times()
    per_stage = tuple(np.abs(np.random.default_rng(1).normal(size=(10, 4))) for _ in range(4))
    assert balance.sim_times(f, b, "linear") == (f, b)
    assert balance.sim_stage_costs(per_stage, "linear") is per_stage
    assert balance.sim_stage_costs(per_stage, "convex") is per_stage


def test_per_microbatch_adds_a_share_of_the_mean_where_there_is_work(balance):
    f, b = _times()
    ref = (np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 4.0, 6.0, 8.0]))
    f2, b2 = balance.sim_times(f, b, "per-microbatch", ref)
    used = f > 0
    np.testing.assert_array_equal(f2[~used], 0.0)
    np.testing.assert_allclose((f2 - f)[used], np.broadcast_to(0.1 * ref[0], f.shape)[used])
    np.testing.assert_allclose(b2 - b, 2 * (f2 - f))


def test_convex_charges_the_distance_from_a_fixed_mean_microbatch(balance):
    f, b = _times()
    ref = (np.full(4, 1.25), np.full(4, 2.5))
    f2, b2 = balance.sim_times(f, b, "convex", ref)
    assert (f2 >= f).all() and (b2 >= b).all()
    np.testing.assert_array_equal(f2[f == 0], 0.0)
    used = f > 0
    want = 0.3 * 1.25 * np.minimum((f / 1.25 - 1) ** 2, 0.25)
    np.testing.assert_allclose((f2 - f)[used], want[used])
    at_ref = np.full_like(f, 1.25)
    np.testing.assert_array_equal(balance.sim_times(at_ref, 2 * at_ref, "convex", ref)[0], at_ref)
    # the reference does not follow the batch: a uniformly heavier iteration pays more
    heavy = balance.sim_times(2 * at_ref, 4 * at_ref, "convex", ref)[0]
    assert (heavy > 2 * at_ref).all()
    # past half a mean microbatch from the mean the penalty stops growing
    far = balance.sim_times(6 * at_ref, 12 * at_ref, "convex", ref)[0]
    np.testing.assert_allclose(far - 6 * at_ref, 0.3 * 1.25 * 0.25)


def test_the_mean_microbatch_is_the_mean_sample_times_its_count(balance):
    rng = np.random.default_rng(3)
    per_stage = tuple(rng.uniform(0.0, 1.0, (20, 3)) for _ in range(4))
    ef, eb, lf, lb = per_stage
    fwd, bwd = balance.mean_microbatch(per_stage, 4.0)
    np.testing.assert_allclose(fwd, 4.0 * (ef + lf).mean(axis=0))
    np.testing.assert_allclose(bwd, 4.0 * (eb + lb).mean(axis=0))


def test_per_sample_charges_only_the_samples_that_use_a_stage(balance):
    rng = np.random.default_rng(2)
    ef = rng.uniform(1.0, 3.0, (12, 2))
    ef[::2, 0] = 0.0  # text-only samples: no encoder work on stage 0
    per_stage = (ef, ef, ef, ef)
    got = balance.sim_stage_costs(per_stage, "per-sample")
    np.testing.assert_array_equal(got[0][::2, 0], 0.0)
    used = ef[:, 0] > 0
    np.testing.assert_allclose(got[0][used, 0] - ef[used, 0], 0.1 * ef[used, 0].mean())
    np.testing.assert_allclose(got[0][:, 1] - ef[:, 1], 0.1 * ef[:, 1].mean())


def test_mixes_draw_every_corpus_in_its_share_with_unique_keys(balance, shared_data):
    """``--mixes``: rows of several real corpora in the mix's shares, repeated rows renamed
    (a table's keys are unique), shuffled."""
    common = sys.modules["_common"]
    mix = {"sroie-docs": 0.25, "llava-instruct": 0.75}
    t = common.mixed_table(mix, 4000, seed=3)
    assert len(t) == 4000 and len(set(t.keys)) == 4000
    corpus = np.array([k.split("/")[0] for k in t.keys])
    assert set(corpus) == {"sroie", "llava"} and (corpus == "sroie").sum() == 1000
    assert any("#" in k for k in t.keys)  # SROIE has fewer than 1000 receipts: rows repeat
    assert corpus[:1000].tolist() != sorted(corpus[:1000].tolist())  # shuffled
