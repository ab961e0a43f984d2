"""Assignment invariants for every method (hypothesis) and the error cases."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entrain_data.assignment import CAP_AWARE, DEFERRING, METHODS, assign, check_assignment
from entrain_data.assignment.common import random_cut_cv
from entrain_data.assignment.entrain import _STRAGGLER_CV
from entrain_data.assignment.pipeline_search import cv_limits
from entrain_data.errors import InvalidInput


@st.composite
def batches(draw):
    dp = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    b = draw(st.integers(dp * m, dp * m + 40))
    e = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 400, b)
    if draw(st.booleans()):  # heavy tail
        tokens[rng.random(b) < 0.05] *= 8
    enc = rng.lognormal(0, 1.2, (b, e)) * (rng.random((b, e)) < 0.7)
    llm = tokens * 1e-3 + (tokens / 1000.0) ** 2
    cap_slack = draw(st.sampled_from([None, 1.0, 1.5, 3.0]))
    cap = None if cap_slack is None else int(max(tokens.max(), cap_slack * tokens.sum() / (dp * m)))
    budget = draw(st.sampled_from([None, 0, 200, 5000]))
    return enc, llm, tokens, dp, m, cap, budget, seed


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches())
def test_invariants_hold_for_every_method(method, case):
    enc, llm, tokens, dp, m, cap, budget, seed = case
    cap_m = cap if method in CAP_AWARE else None
    try:
        a = assign(
            enc,
            llm,
            tokens,
            dp=dp,
            microbatches=m,
            max_tokens=cap_m,
            defer_budget=budget,
            method=method,
            seed=seed,
            iteration=3,
        )
    except InvalidInput as exc:  # a cap that cannot be met must say so
        assert "max_tokens" in str(exc)
        return
    check_assignment(a, len(llm), tokens, cap_m, budget if method in DEFERRING else None)
    assert a.dp == dp and a.microbatches == m
    if method not in DEFERRING:
        for r in range(dp):
            for j in range(m):
                assert np.array_equal(a.encoder_sets[r][j], a.llm_sets[r][j])
    if method != "wlb_llm":
        assert len(a.carried) == 0
    # deterministic for a seed and iteration
    b = assign(
        enc,
        llm,
        tokens,
        dp=dp,
        microbatches=m,
        max_tokens=cap_m,
        defer_budget=budget,
        method=method,
        seed=seed,
        iteration=3,
    )
    assert a.to_dict() == b.to_dict()


def test_entrain_llm_sets_defer_forward_only_and_balance():
    rng = np.random.default_rng(0)
    b, dp, m = 512, 4, 32
    tokens = rng.integers(200, 3000, b)
    # tail light enough that no single sample outweighs a microbatch's mean (4 samples)
    enc = rng.lognormal(0, 0.5, b)
    llm = tokens * 1e-4
    a = assign(enc, llm, tokens, dp=dp, microbatches=m, method="entrain")
    s = assign(enc, llm, tokens, dp=dp, microbatches=m, method="sequential")
    check_assignment(a, b, tokens)

    def cv(sets, cost):
        loads = np.array([cost[x].sum() for row in sets for x in row])
        return loads.std() / loads.mean()

    assert cv(a.encoder_sets, enc) < cv(s.encoder_sets, enc) / 5
    # the paper reports 4.1x; the LPT/deferral sets reach 4.2x here, and the pipeline search
    # (pipeline_search.py) may then let the L sets' CV grow by up to 10% for iteration time
    assert cv(a.llm_sets, llm) < cv(s.llm_sets, llm) / 3.5
    assert any(len(mb.deferred) for mb in [_Deferred(a, r, j) for r in range(dp) for j in range(m)])


def _waterfill_cv(items: np.ndarray, m: int) -> float:
    """Lowest CV any whole-sample split of ``items`` into m bins can reach (fractional bound)."""
    items = np.sort(items)[::-1]
    loads, rest = [], items.sum()
    for k in range(m):
        if items[k] > rest / (m - k):
            loads.append(items[k])
            rest -= items[k]
        else:
            loads += [rest / (m - k)] * (m - k)
            break
    arr = np.array(loads)
    return float(arr.std() / arr.mean())


def test_entrain_encoder_sets_reach_the_whole_sample_bound_on_heavy_tails():
    rng = np.random.default_rng(0)
    enc = rng.lognormal(0, 1.0, 512)  # outliers bigger than a mean microbatch
    tokens = rng.integers(200, 3000, 512)
    a = assign(enc, tokens * 1e-4, tokens, dp=4, microbatches=32)
    for r in range(4):
        loads = np.array([enc[s].sum() for s in a.encoder_sets[r]])
        bound = _waterfill_cv(enc[np.concatenate(a.encoder_sets[r])], 32)
        # LPT sets within 5% of the bound; the pipeline search may then trade up to its
        # documented encoder-CV allowance (cv_limits) for a shorter pipeline
        lpt = bound * 1.05 + 1e-3
        mine = np.concatenate(a.encoder_sets[r])
        cost = np.stack([enc[mine], tokens[mine] * 1e-4], axis=1)[None]
        valid = np.ones((1, len(mine)), bool)
        limit = cv_limits(np.array([[lpt, 0.0]]), cost, valid, 32)[0, 0]
        # or, on a replica slower than the others can be, the faster candidate the
        # straggler rule takes: every module within 3/4 of a random cut's CV
        share = _STRAGGLER_CV
        if len(mine) < 512 // 4:  # it stalled and gave samples away (stall_shed): its sets
            share = 1.0  # are rebuilt alone, held to a random cut's CV (measured 0.77 of it)
        limit = max(limit, share * random_cut_cv(cost, valid, 32)[0, 0])
        assert loads.std() / loads.mean() <= limit


class _Deferred:
    def __init__(self, a, r, j):
        self.deferred = np.setdiff1d(a.llm_sets[r][j], a.encoder_sets[r][j])


def test_zero_budget_means_no_deferral():
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 500, 64)
    a = assign(rng.random(64), tokens * 1.0, tokens, dp=2, microbatches=4, defer_budget=0)
    check_assignment(a, 64, tokens, None, 0)
    enc_r, enc_j = a.encoder_slots(64)
    llm_r, llm_j = a.llm_slots(64)
    assert np.array_equal(enc_j, llm_j)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": np.array([1, 2, 999, 4] * 4)}, "sample 2 has 999 tokens"),
        ({"llm_cost": np.array([np.nan] + [1.0] * 15)}, "llm_cost is NaN"),
        ({"encoder_cost": -np.ones(16)}, "encoder_cost is negative"),
        ({"llm_cost": np.ones(15)}, "mismatched lengths"),
        ({"dp": 0}, "dp must be"),
        ({"microbatches": 0}, "microbatches must be"),
        ({"dp": 4, "microbatches": 5}, "cannot fill"),
        ({"method": "magic"}, "unknown assignment method"),
        ({"pipeline_stages": 0}, "pipeline_stages must be"),
        ({"pipeline_stages": True}, "pipeline_stages must be"),
        ({"pipeline_stages": 2.5}, "pipeline_stages must be"),
        # ran for seconds (the proxy pipeline grows with the depth); overflowed in the CVs
        ({"pipeline_stages": 10**6}, "pipeline_stages must be an integer from 1 to 1024"),
        ({"encoder_cost": np.full(16, 1e200)}, "encoder_cost of sample 0 is above 1e"),
        ({"llm_cost": np.r_[np.ones(5), 1e300, np.ones(10)]}, "llm_cost of sample 5 is above"),
        # each of these raised numpy's own error, or named the wrong cause
        ({"encoder_cost": np.array(["a"] * 16)}, "encoder_cost must be real numbers"),
        ({"llm_cost": np.ones(16) + 1j}, "llm_cost must be real numbers"),
        ({"tokens": np.array(["x"] * 16)}, "tokens must be whole numbers"),
        ({"tokens": np.full(16, 1e30)}, "too large"),
        ({"tokens": np.full(16, 2**63 + 5, np.uint64)}, "too large"),
        ({"dp": True}, "dp must be"),
        ({"max_tokens": True}, "max_tokens must be"),
        ({"max_delay": True}, "max_delay must be"),
        ({"iteration": None}, "iteration must be"),
        ({"seed": 1.5}, "seed must be"),
        (
            {"encoder_patches": np.ones(16, int), "max_encoder_patches": [5, 5, 5]},
            "one cap or one per encoder column",
        ),
    ],
)
def test_bad_input_names_the_problem(kwargs, match):
    args = {
        "encoder_cost": np.ones(16),
        "llm_cost": np.ones(16),
        "tokens": np.full(16, 10),
        "dp": 2,
        "microbatches": 2,
        "max_tokens": 100,
    }
    args.update(kwargs)
    enc, llm, tok = args.pop("encoder_cost"), args.pop("llm_cost"), args.pop("tokens")
    with pytest.raises(ValueError, match=match):
        assign(enc, llm, tok, **args)


def test_wlb_llm_carries_outliers_to_the_next_iteration():
    tokens = np.array([100] * 60 + [5000] * 2)
    cost = tokens.astype(float)
    a = assign(np.zeros(62), cost, tokens, dp=2, microbatches=4, method="wlb_llm")
    assert sorted(a.carried.tolist()) == [60, 61]
    check_assignment(a, 62, tokens)


def test_wlb_llm_flush_releases_the_queue_and_other_methods_ignore_it():
    """The last iteration of a run trains every queued outlier; flush changes nothing else."""
    tokens = np.array([100] * 60 + [5000] * 2)
    cost = tokens.astype(float)
    a = assign(np.zeros(62), cost, tokens, dp=2, microbatches=4, method="wlb_llm", flush=True)
    assert len(a.carried) == 0
    check_assignment(a, 62, tokens)
    # one outlier per microbatch while they last: the two never share a microbatch
    rep, mb = a.llm_slots(62)
    assert (rep[60], mb[60]) != (rep[61], mb[61])
    for method in ("entrain", "verl_kk", "sequential"):
        plain = assign(np.ones(62), cost, tokens, dp=2, microbatches=4, method=method)
        flushed = assign(np.ones(62), cost, tokens, dp=2, microbatches=4, method=method, flush=True)
        assert plain.to_dict() == flushed.to_dict()


def test_megatron_dp_balanced_keeps_original_order():
    tokens = np.full(32, 10)
    a = assign(
        np.zeros(32), np.ones(32), tokens, dp=2, microbatches=4, method="megatron_dp_balanced"
    )
    # packs of consecutive samples, pack i*dp + r to replica r microbatch i
    assert a.llm_sets[0][0].tolist() == [0, 1, 2, 3]
    assert a.llm_sets[1][0].tolist() == [4, 5, 6, 7]


def test_large_batch_path_keeps_the_invariants():
    # from 4096 samples entrain tries fewer level-2 candidates (latency): same invariants
    rng = np.random.default_rng(5)
    b, dp, m = 4096, 16, 8
    tokens = rng.integers(50, 3000, b)
    enc = rng.lognormal(0, 0.8, (b, 2)) * (rng.random((b, 2)) < 0.6)
    llm = tokens * 1e-4 + (tokens / 1e4) ** 2
    per_mb = tokens.sum() / (dp * m)
    cap, budget = int(max(tokens.max(), 1.5 * per_mb)), int(2 * per_mb)
    a = assign(enc, llm, tokens, dp=dp, microbatches=m, max_tokens=cap, defer_budget=budget)
    check_assignment(a, b, tokens, cap, budget)


def test_every_encoder_column_is_balanced_not_only_their_sum():
    # vision-only and audio-only samples: a stage holding only the audio encoder sees column 1
    rng = np.random.default_rng(6)
    b, dp, m = 512, 4, 32
    kind = rng.random(b) < 0.5
    enc = np.stack([np.where(kind, rng.lognormal(0, 0.4, b), 0), np.where(kind, 0, 1.0)], 1)
    tokens = rng.integers(100, 800, b)
    llm = tokens * 1e-3
    a = assign(enc, llm, tokens, dp=dp, microbatches=m, method="entrain")
    s = assign(enc, llm, tokens, dp=dp, microbatches=m, method="sequential")

    def col_cv(x, e):
        loads = np.array([enc[i, e].sum() for row in x.encoder_sets for i in row])
        return loads.std() / loads.mean()

    for e in (0, 1):
        assert col_cv(a, e) < col_cv(s, e) / 2


def test_a_numba_that_cannot_be_imported_falls_back_to_numpy(tmp_path):
    """A numba built for another numpy fails at import: assign warns once and runs numpy."""
    fake = tmp_path / "numba"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('built for another numpy')\n")
    code = (
        "import warnings, numpy as np\n"
        "from entrain_data.assignment import assign, check_assignment\n"
        "rng = np.random.default_rng(0)\n"
        "tok = rng.integers(10, 100, 64)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    a = assign(rng.random((64, 1)), tok * 1e-3, tok, dp=2, microbatches=4)\n"
        "check_assignment(a, 64, tok)\n"
        "assert any('cannot be imported' in str(x.message) for x in w), [str(x.message) for x in w]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    env.pop("ENTRAIN_NUMBA", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
