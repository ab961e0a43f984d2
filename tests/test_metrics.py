"""Balance metrics against hand-computed loads."""

from __future__ import annotations

import numpy as np
import pytest

from entrain_data.assignment import Assignment, assign
from entrain_data.errors import InvalidInput
from entrain_data.metrics import load_cv, microbatch_loads, sets_sum, stage_cv


def _a(enc_sets, llm_sets):
    return Assignment("hand", len(enc_sets), len(enc_sets[0]), enc_sets, llm_sets)


def test_loads_follow_encoder_and_llm_sets_separately():
    i = lambda *x: np.array(x, dtype=np.int64)  # noqa: E731
    a = _a([[i(0, 1), i(2)], [i(3), i()]], [[i(0), i(1, 2)], [i(), i(3)]])
    enc = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]])
    llm = np.array([100.0, 200.0, 300.0, 400.0])
    loads = microbatch_loads(a, enc, llm)
    assert loads.encoder.tolist() == [[33.0, 33.0], [44.0, 0.0]]
    assert loads.encoder_by_module[0, 0].tolist() == [3.0, 30.0]
    assert loads.llm.tolist() == [[100.0, 500.0], [0.0, 400.0]]
    cv = loads.cv()
    assert set(cv) == {"encoder", "llm", "encoder0", "encoder1"}
    x = np.array([33.0, 33.0, 44.0, 0.0])
    assert cv["encoder"] == pytest.approx(x.std() / x.mean())


def test_load_cv_edge_cases():
    assert load_cv(np.full((3, 4), 2.5)) == 0.0
    assert load_cv(np.zeros(5)) == 0.0
    assert load_cv(np.array([1.0, 3.0])) == pytest.approx(0.5)
    with pytest.raises(InvalidInput, match="no loads"):
        load_cv(np.zeros(0))


def test_stage_cv_per_stage():
    f = np.zeros((2, 2, 2))
    f[..., 0] = [[1.0, 1.0], [1.0, 1.0]]
    f[..., 1] = [[1.0, 3.0], [1.0, 3.0]]
    assert stage_cv(f, f).tolist() == pytest.approx([0.0, 0.5])
    with pytest.raises(InvalidInput):
        stage_cv(f, f[:1])


def test_sets_sum_matches_a_loop_on_a_real_assignment():
    rng = np.random.default_rng(3)
    tok = rng.integers(1, 300, 97)
    enc = rng.random((97, 2))
    a = assign(enc, tok * 1.0, tok, dp=3, microbatches=5, seed=1)
    got = sets_sum(a.llm_sets, tok)
    want = [[tok[s].sum() for s in row] for row in a.llm_sets]
    assert got.tolist() == want
    with pytest.raises(InvalidInput, match="microbatch_loads"):
        microbatch_loads(a, enc, tok[:5] * 1.0)
