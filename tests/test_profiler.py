"""Macro profiler: batch-sum spread shrinks about as 1/sqrt(B); seeded; JSON round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput
from entrain_data.presets import ModelSpec
from entrain_data.profiler import MacroProfile, macro_profile, module_costs
from entrain_data.workloads import synthesize

SPEC = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")


@pytest.fixture(scope="module")
def table():
    return synthesize("qwen2vl-dynamic", 16384, seed=3)


def test_batch_sums_are_sums_over_the_drawn_batches(table):
    p = macro_profile(table, SPEC, 256, batches=8, seed=1)
    assert p.batch_indices.shape == (8, 256)
    for row in p.batch_indices:
        assert len(np.unique(row)) == 256  # without replacement inside a batch
    work = module_costs(per_sample_costs(table, SPEC))
    assert np.allclose(p.batch_sums, work[p.batch_indices].sum(axis=1))
    assert p.module_names == ("qwen2.5-vl-vision", "llm")
    assert np.allclose(p.ratio, p.batch_sums[:, 0] / p.batch_sums[:, 1])
    q = macro_profile(table, SPEC, 256, batches=8, seed=1)
    assert np.array_equal(p.batch_indices, q.batch_indices)
    r = macro_profile(table, SPEC, 256, batches=8, seed=2)
    assert not np.array_equal(p.batch_indices, r.batch_indices)


def test_cv_shrinks_like_one_over_sqrt_b(table):
    p = macro_profile(table, SPEC, 1024, batches=64, seed=0, scaling_sizes=(16, 64, 256, 1024))
    law = p.law_cv(np.array(p.scaling_sizes))
    # measured CV within 35% of the law at every size (64 batches: CV of a CV estimate ~ 9%+)
    assert np.all(np.abs(p.scaling_cv / law - 1) < 0.35), (p.scaling_cv, law)
    # and 4x the batch halves it (roughly)
    assert np.all(p.scaling_cv[1:] < p.scaling_cv[:-1])
    slope = np.polyfit(np.log(p.scaling_sizes), np.log(p.scaling_cv[:, 1]), 1)[0]
    assert -0.65 < slope < -0.4
    # the encoder:LLM ratio concentrates too
    assert p.scaling_ratio_cv[-1] < p.scaling_ratio_cv[0] / 4
    assert p.cv[1] < p.sample_cv[1] / 10


def test_json_round_trip_and_table(table, tmp_path):
    p = macro_profile(table, SPEC, 128, batches=4, seed=0)
    q = MacroProfile.from_dict(json.loads(p.to_json()))
    assert np.array_equal(q.batch_indices, p.batch_indices)
    assert np.allclose(q.cv, p.cv) and q.ratio_cv == pytest.approx(p.ratio_cv)
    text = p.format_table()
    assert "qwen2.5-vl-vision" in text and "encoder:LLM" in text and "1/sqrt(B)" in text
    png = p.plot(tmp_path / "cv.png")
    assert png.stat().st_size > 1000


def test_bad_batch_arguments(table):
    with pytest.raises(InvalidInput, match="exceeds"):
        macro_profile(table, SPEC, len(table) + 1)
    with pytest.raises(InvalidInput, match="global_batch"):
        macro_profile(table, SPEC, 0)
    with pytest.raises(InvalidInput, match="batches"):
        macro_profile(table, SPEC, 8, batches=0)


def test_table_shows_small_and_large_batch_times_in_readable_units(table):
    from entrain_data.profiler import format_seconds

    assert format_seconds(2.5) == "2.5 s"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(4.2e-5) == "42 us"
    text = macro_profile(table, SPEC, 128, batches=4, seed=0).format_table()
    assert "0.0000" not in text.split("batch-sum CV")[0]
