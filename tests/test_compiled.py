"""The compiled twins (numba) return exactly what the numpy code returns (issue 12).

Every case runs the public entry point twice, ``ENTRAIN_NUMBA=0`` and compiled, and
compares sets element for element (and errors message for message): a compiled kernel
that rounds one sum differently, breaks a tie the other way or draws one random number
more shows up here as a different assignment.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_assignment_caps_delay import _batch  # heavy-tailed tokens, text-only samples
from test_assignment_light_work import two_encoder_deal  # a light deal, two encoders
from test_assignment_slot_order import SHUFFLED, _state  # entrain's sets, slots shuffled

from entrain_data import compiled
from entrain_data.assignment import assign, check_assignment
from entrain_data.assignment.pipeline_search import stage_costs
from entrain_data.assignment.slot_order import order_slowest
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput
from entrain_data.presets import ModelSpec
from entrain_data.simulator import simulate_pipeline
from entrain_data.workloads import synthesize

pytest.importorskip("numba", reason="numba (the 'fast' extra) is not installed")


def _both(fn):
    """``fn()`` on the numpy path and on the compiled one: (numpy result, compiled result)."""
    out = []
    for flag in ("0", "1"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ENTRAIN_NUMBA", flag)
            assert compiled.enabled() == (flag == "1")  # the second run is really compiled
            try:
                out.append(fn())
            except InvalidInput as exc:
                out.append(f"InvalidInput: {exc}")
    return out


def _same_sets(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    pairs = zip(a.encoder_sets + a.llm_sets, b.encoder_sets + b.llm_sets, strict=True)
    return all(np.array_equal(x, y) for ra, rb in pairs for x, y in zip(ra, rb, strict=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    dp=st.sampled_from([1, 2, 5, 40]),
    m=st.integers(2, 12),
    per=st.integers(0, 12),
    e=st.integers(1, 3),
    caps=st.booleans(),
    budget=st.sampled_from([None, 0.5, 4.0]),
    frozen=st.booleans(),
    told=st.sampled_from([None, 4]),
)
def test_assign_compiled_equals_numpy(seed, dp, m, per, e, caps, budget, frozen, told):
    rng = np.random.default_rng(seed)
    b = dp * m + dp * per
    enc, llm, tok, pt = _batch(rng, b, e)
    mean_mb = tok.sum() / (dp * m)
    kw = dict(dp=dp, microbatches=m, seed=seed, iteration=seed % 5, encoder_patches=pt)
    kw.update(frozen_encoders=frozen, pipeline_stages=told)
    if caps:
        kw["max_tokens"] = int(max(tok.max(), 1.5 * mean_mb))
        pmean = pt.sum(axis=0) / (dp * m)
        kw["max_encoder_patches"] = np.maximum(pt.max(axis=0), (1.5 * pmean).astype(np.int64))
    if budget is not None:
        kw["defer_budget"] = int(budget * mean_mb)
    numpy_path, compiled = _both(lambda: assign(enc, llm, tok, **kw))
    assert _same_sets(numpy_path, compiled), (numpy_path, compiled)
    if not isinstance(compiled, str):
        check_assignment(
            compiled, b, tok, kw.get("max_tokens"), kw.get("defer_budget"), pt,
            kw.get("max_encoder_patches"),
        )  # fmt: skip


@pytest.mark.parametrize("told", [None, 4])
@pytest.mark.parametrize(
    ("workload", "b", "dp", "m"),
    [("qwen2vl-dynamic", 2048, 64, 16), ("text-heavy", 1024, 8, 16), ("vision-audio", 512, 4, 32)],
)
def test_assign_compiled_equals_numpy_on_workloads(workload, b, dp, m, told):
    """Real-shaped mixes under the cost model, including more replicas than the search
    focuses on (64 > 32); told the depth, the search's per-replica room beside outliers
    (``pipeline_search.outliers``) runs too."""
    encoders = ["qwen2.5-vl-vision", "whisper-large-v3-encoder"]
    costs = per_sample_costs(
        synthesize(workload, b, seed=3), ModelSpec.from_names(encoders, "llama-3.2-1b")
    )
    enc, llm, tok = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens
    mean_mb = tok.sum() / (dp * m)
    kw = dict(dp=dp, microbatches=m, defer_budget=int(2 * mean_mb), iteration=1)
    kw.update(max_tokens=int(max(tok.max(), 1.5 * mean_mb)), pipeline_stages=told)
    numpy_path, compiled = _both(lambda: assign(enc, llm, tok, **kw))
    assert _same_sets(numpy_path, compiled)


@pytest.mark.parametrize("shape", [(9, 12, 4), (5, 3, 6), (4, 7, 1), (3, 1, 3)])
def test_simulation_compiled_equals_numpy(shape):
    # fewer microbatches than stages, one stage and one microbatch included
    rng = np.random.default_rng(7)
    fwd = rng.random(shape) * rng.integers(0, 2, shape)  # zeros included
    bwd = rng.random(shape) * 2.0
    a, b = _both(lambda: simulate_pipeline(fwd, bwd))
    assert np.array_equal(a.replica_times, b.replica_times)
    assert (a.iteration_time, a.bubble_fraction) == (b.iteration_time, b.bubble_fraction)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 5),
    n=st.integers(2, 90),
    m=st.integers(2, 12),
    d=st.integers(1, 9),
    ones=st.booleans(),
    shaped=st.booleans(),
    weighted=st.booleans(),
)
def test_vector_refinement_compiled_equals_numpy(seed, rows, n, m, d, ones, shaped, weighted):
    # the refinement on its own: ties (a count column) and every column count, 9 included;
    # toward equal bins and toward a shaped profile (light edges)
    from entrain_data.assignment.shaping import edge_shape

    rng = np.random.default_rng(seed)
    w = rng.lognormal(0, 1, (rows, n, d))
    if ones:
        w[..., 0] = 1.0
    valid = rng.random((rows, n)) < 0.9
    prof = 1.0 + rng.random((rows, 1)) * 0.3 * edge_shape(m)[None, :] if shaped else None

    weight = rng.integers(1, 17, d).astype(float) if weighted else None  # columns counted k times
    _vector_refinement_agrees(w, valid, m, 4 * m, profile=prof, weight=weight)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 6),
    n=st.integers(1, 200),
    m=st.integers(2, 16),
    ties=st.booleans(),
    cut=st.booleans(),
)
def test_bin_refinement_compiled_equals_numpy(seed, rows, n, m, ties, cut):
    # LPT's bins (or a random cut: many steps before no exchange helps) refined by swaps and
    # moves between the heaviest and lightest bin: equal costs (a few values), invalid
    # members, bins of 1 to 100 items
    from entrain_data.assignment.encoder_sets import lpt_bins, refine_bins

    rng = np.random.default_rng(seed)
    cost = rng.integers(1, 4, (rows, n)) * 0.5 if ties else rng.lognormal(0, 1, (rows, n))
    valid = rng.random((rows, n)) < 0.9
    start = np.where(valid, rng.integers(0, m, (rows, n)), -1) if cut else None

    def refined():
        bins = lpt_bins(cost, valid, m) if start is None else start.copy()
        refine_bins(bins, cost, valid, m, iters=4 * m)
        return bins

    a, b = _both(refined)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("n, m", [(150, 3), (400, 3), (600, 2)])
def test_vector_refinement_compiled_equals_numpy_on_large_bins(n, m):
    # bins of 50 to 300 items: more than the items tried per bin (32), and past the size
    # where the compiled twin stops sorting them in place (64)

    rng = np.random.default_rng(n + m)
    w = rng.lognormal(0, 1, (2, n, 3))
    w[..., 0] = 1.0  # a count: ties
    valid = rng.random((2, n)) < 0.95
    _vector_refinement_agrees(w, valid, m, 8 * m)


def _vector_refinement_agrees(w, valid, m, iters, profile=None, weight=None):
    """Vector LPT bins of ``w`` refined ``iters`` steps: the same with numba and without."""
    from entrain_data.assignment.encoder_sets import refine_vector, vector_bins

    def refined():
        bins = vector_bins(w, valid, m, weight)
        refine_vector(bins, w, valid, m, iters=iters, profile=profile, weight=weight)
        return bins

    a, b = _both(refined)
    assert np.array_equal(a, b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 6),
    n=st.integers(0, 80),
    m=st.integers(1, 12),
    ties=st.booleans(),
)
def test_lpt_bins_compiled_equals_numpy(seed, rows, n, m, ties):
    # largest-first placement item by item: equal costs (a count) and equal bin loads
    # break ties the same way, invalid members stay -1
    from entrain_data.assignment.encoder_sets import lpt_bins

    rng = np.random.default_rng(seed)
    cost = rng.integers(1, 4, (rows, n)).astype(float) if ties else rng.lognormal(0, 1, (rows, n))
    valid = rng.random((rows, n)) < 0.85
    a, b = _both(lambda: lpt_bins(cost, valid, m))
    assert np.array_equal(a, b)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), m=st.integers(3, 12), budget=st.sampled_from([None, 1.0]))
def test_shaped_llm_fill_compiled_equals_numpy(seed, m, budget):
    # the deferring LLM sets filled toward a shaped running target
    from entrain_data.assignment.common import Inputs
    from entrain_data.assignment.encoder_sets import lpt_bins
    from entrain_data.assignment.entrain import replicas_of
    from entrain_data.assignment.llm_sets import llm_sets_fill
    from entrain_data.assignment.shaping import edge_shape

    rng = np.random.default_rng(seed)
    dp, per = 3, 6
    enc, llm, tok, _ = _batch(rng, dp * m * per, 1)
    mean_mb = tok.sum() / (dp * m)
    bud = None if budget is None else int(budget * mean_mb)
    x = Inputs(enc, llm, tok, dp, m, max_tokens=None, defer_budget=bud)
    rp = replicas_of(x, np.arange(len(llm)).reshape(dp, -1))
    eidx = lpt_bins(rp.enc_w, rp.has_enc, m)
    prof = 1.0 + rng.random((dp, 1)) * 0.3 * edge_shape(m)[None, :]

    def filled():
        c = llm_sets_fill(rp, eidx, 0.02, prof)
        return c.lidx, c.failed

    (la, fa), (lb, fb) = _both(filled)
    assert np.array_equal(la, lb) and np.array_equal(fa, fb)


@pytest.mark.parametrize("extra", [(), (1,), (4,), (2, 3)])
def test_slot_sums_compiled_equals_numpy(extra):
    from entrain_data.assignment.common import slot_sums

    rng = np.random.default_rng(len(extra))
    idx = rng.integers(-1, 7, (5, 40))
    valid = rng.random((5, 40)) < 0.8
    values = rng.lognormal(0, 2, (5, 40) + extra)
    a, b = _both(lambda: slot_sums(idx, values, valid, 7))
    assert a.shape == b.shape == (5, 7) + extra
    assert np.array_equal(a, b)
    ints = rng.integers(0, 1000, (5, 40))
    a, b = _both(lambda: slot_sums(idx, ints, valid, 7))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("stages", [1, 4])
def test_proxy_loads_compiled_equals_numpy(stages):
    # the search's forward and backward loads in one pass: unplaced members (-1), pads,
    # E and L sets apart
    from entrain_data.assignment.pipeline_search import _proxy_loads

    rng = np.random.default_rng(stages)
    eidx = rng.integers(-1, 6, (4, 30))
    lidx = np.where(eidx < 0, rng.integers(-1, 6, (4, 30)), eidx + rng.integers(0, 2, (4, 30)))
    lidx = np.minimum(lidx, 5)
    valid = rng.random((4, 30)) < 0.85
    ef, lf, lb = (rng.lognormal(0, 2, (4, 30, stages)) for _ in range(3))
    (fa, ba), (fb, bb) = _both(lambda: _proxy_loads(eidx, lidx, ef, lf, lb, valid, 6))
    assert fa.shape == fb.shape == ba.shape == (4, 6, stages)
    assert np.array_equal(fa, fb) and np.array_equal(ba, bb)


@pytest.mark.parametrize("e, frozen", [(1, None), (2, None), (2, [True, False]), (3, [True] * 3)])
def test_stage_costs_and_depth_blind_price_compiled_equal_numpy(e, frozen):
    # the proxy's per-sample stage costs (pads zero) and the untold pick's price on 2, 4 and 8
    # stages: the compiled twins build the same loads in one pass
    from entrain_data.assignment.common import Inputs
    from entrain_data.assignment.entrain import replicas_of
    from entrain_data.assignment.pipeline_search import depth_blind_pricer, stage_costs

    rng = np.random.default_rng(e)
    dp, m, per = 5, 6, 9
    enc, llm, tok, _ = _batch(rng, dp * per - 3, e)
    fz = None if frozen is None else np.array(frozen)
    x = Inputs(enc, llm, tok, dp, m, max_tokens=None, defer_budget=None, frozen=fz)
    members = np.append(rng.permutation(len(llm)), [-1] * 3).reshape(dp, per)
    rp = replicas_of(x, members)
    a, b = _both(lambda: stage_costs(rp))
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    assert all((u[~rp.valid] == 0).all() for u in b)
    eidx = np.where(rp.valid, rng.integers(0, m, members.shape), -1)
    lidx = np.where(rp.valid, np.minimum(eidx + rng.integers(0, 2, eidx.shape), m - 1), -1)
    for kw in ({}, {"per_depth": True}, {"in_work": True}):
        a, b = _both(lambda kw=kw: depth_blind_pricer(rp)(eidx, lidx, **kw))
        assert np.array_equal(a, b)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    dp=st.sampled_from([2, 3, 7, 40, 128]),
    per=st.integers(1, 90),
    d=st.integers(1, 9),
    pad=st.booleans(),
    m=st.sampled_from([None, 1, 4]),
)
def test_level1_split_compiled_equals_numpy(seed, dp, per, d, pad, m):
    # level 1 on its own: both refinements and the polish (``m``: replicas holding a
    # stalling sample sit it out), more members than either samples (16, 64), pads (B not
    # a multiple of dp), ties (a count column), an idle module (zeros)
    from entrain_data.assignment.replica_split import norm_columns, split_replicas

    rng = np.random.default_rng(seed)
    b = dp * per - (int(rng.integers(1, dp)) if pad and per > 1 else 0)
    w = rng.lognormal(0, 1.5, (b, d))
    if d > 1:
        w[:, 0] = 1.0
    if d > 2:
        w[:, 1] = 0.0
    a, c = _both(
        lambda: split_replicas(norm_columns(w), dp, np.random.default_rng(seed), microbatches=m)
    )
    assert np.array_equal(a, c)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), m=st.integers(1, 12), k=st.integers(1, 3))
def test_cap_packing_compiled_equals_numpy(seed, m, k):
    from entrain_data.assignment.replica_split import _packs

    rng = np.random.default_rng(seed)
    sizes = rng.random((9, 30, k)) * rng.uniform(0.05, 0.6) * (rng.random((9, 30, 1)) < 0.9)
    sizes[0, :, :] = 0.0  # pads only
    a, c = _both(lambda: _packs(sizes, m))
    assert a.dtype == c.dtype == bool and np.array_equal(a, c)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    m=st.integers(2, 10),
    e=st.integers(1, 2),
    patch_cap=st.booleans(),
    twins=st.booleans(),
    weighted=st.booleans(),
)
def test_joint_repair_compiled_equals_numpy(seed, m, e, patch_cap, twins, weighted):
    # joint sets cut at random, caps 1.1x a mean set: most sets start above one and the
    # repair runs hundreds of exchanges; twins (every sample twice, as the delay's landing
    # prices) make exact ties in work
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.assignment.entrain import replicas_of
    from entrain_data.assignment.llm_sets import fits_cap, repair_joint

    rng = np.random.default_rng(seed)
    dp, per = 3, 12
    half = dp * m * per // 2 if twins else dp * m * per
    enc, llm, tok, pt = _batch(rng, half, e)
    if twins:
        enc, llm, tok, pt = (np.concatenate([a, a]) for a in (enc, llm, tok, pt))
    b = len(tok)
    cap = int(max(tok.max(), 1.1 * tok.sum() / (dp * m)))
    pcap = np.maximum(pt.max(axis=0), (1.1 * pt.sum(axis=0) / (dp * m)).astype(np.int64))
    x = validate_inputs(
        enc, llm, tok, dp, m, cap, None, pt, pcap if patch_cap else None
    )  # fmt: skip
    rp = replicas_of(x, rng.permutation(b).reshape(dp, -1))
    bins = rng.integers(0, m, (dp, b // dp))
    bins[:, :m] = np.arange(m)
    work = np.concatenate([rp.enc_cols, rp.llm[..., None], rp.tok[..., None] * 1.0], axis=2)
    weight = rng.integers(1, 17, work.shape[2]).astype(float) if weighted else None
    a, c = _both(lambda: repair_joint(rp, bins, work, weight))
    assert np.array_equal(a, c)
    assert fits_cap(rp, c).sum() >= fits_cap(rp, bins).sum()


@pytest.mark.parametrize("seed", range(6))
def test_search_room_beside_an_outlier_compiled_equals_numpy(seed):
    """The search's per-replica limits (a replica holding a sample heavier than a mean
    microbatch may fill sets up to the caps, one without keeps level 2's largest set): the
    kernel and the numpy round agree on a pair of replicas, one of each."""
    from test_assignment_pipeline_search import _replicas

    from entrain_data.assignment.pipeline_search import outliers, refine_by_pipeline

    rng = np.random.default_rng(seed)
    n, m = 40, 6
    enc = np.stack([rng.lognormal(0, 0.8, n), rng.lognormal(0, 0.05, n)])[..., None]
    enc[0, 0] = 3 * enc[0].sum() / m  # three mean microbatches
    tok = np.rint(enc[..., 0] * 200).astype(np.int64) + 1
    llm = tok * 1e-3
    valid = np.ones((2, n), bool)
    eidx = np.tile(np.arange(n) % m, (2, 1))
    cost = np.concatenate([enc, llm[..., None]], axis=2)
    assert outliers(cost, m).any(axis=1).tolist() == [True, False]
    patches = np.rint(enc * 100).astype(np.int64)
    rp = _replicas(valid, valid, enc, llm, tok, m, cap=10**9, patches=patches,
                   patch_cap=np.array([10**9]))  # fmt: skip
    peak = int(np.bincount(np.arange(2 * n) // n * m + eidx.ravel(), tok.ravel()).max())
    runs = _both(lambda: refine_by_pipeline(rp, eidx, eidx, np.random.default_rng(seed), 64))
    (e_np, l_np), (e_c, l_c) = runs
    assert np.array_equal(e_np, e_c) and np.array_equal(l_np, l_c)
    assert np.bincount(l_c[1], tok[1], m).max() <= peak  # no outlier: level 2's largest


@pytest.mark.parametrize("seed", range(6))
def test_fluid_profile_compiled_equals_numpy(seed):
    """The light work's profile (``light_work.fluid_profile``): the compiled probes and the
    numpy ones (which build the loads) give the same descent, share for share."""
    from entrain_data.assignment.light_work import _fluid_cv, fluid_profile

    rng = np.random.default_rng(seed)
    r_count, m, s_count = 3, int(rng.integers(3, 20)), int(rng.integers(1, 6))
    fh = np.zeros((r_count, m, s_count))
    for r in range(r_count):
        fh[r, rng.choice(m, 2, replace=False)] = rng.uniform(0.5, 3.0, (2, s_count))
    fl = rng.uniform(1.0, 8.0, (r_count, s_count))
    upper = rng.uniform(1.5 / m, 4.0 / m, (r_count, m))
    (t_np, a_np), (t_c, a_c) = _both(lambda: fluid_profile(fh, 2 * fh, fl, 2 * fl, upper))
    assert np.array_equal(t_np, t_c) and np.array_equal(a_np, a_c)
    # from uneven shares, a replica stopping at its goal (the compiled descent is one loop)
    uneven = rng.dirichlet(np.ones(m), r_count)
    goal = np.array([t_np[0] * 1.5, 0.0, t_np[2] * 0.999])

    def from_uneven():
        return fluid_profile(fh, 2 * fh, fl, 2 * fl, upper, uneven.copy(), None, goal)

    (t_np, a_np), (t_c, a_c) = _both(from_uneven)
    assert np.array_equal(t_np, t_c) and np.array_equal(a_np, a_c)
    # within a CV bound that turns moves away (the compiled descent skips those), on one to
    # three modules, loose and tight
    k = int(rng.integers(1, 4))
    hk, lk = rng.uniform(0.0, 2.0, (r_count, m, k)), rng.uniform(1.0, 4.0, (r_count, k))
    start = np.full((r_count, m), 1.0 / m)
    limit = _fluid_cv(hk, lk, start) * (1.05 if seed % 2 else 1.001) + (0.01 if seed % 2 else 0)

    def bounded():
        return fluid_profile(fh, 2 * fh, fl, 2 * fl, upper, start, (hk, lk, limit))

    (t_np, a_np), (t_c, a_c) = _both(bounded)
    assert np.array_equal(t_np, t_c) and np.array_equal(a_np, a_c)
    assert (_fluid_cv(hk, lk, a_c) <= limit + 1e-9).all()


@pytest.mark.parametrize(
    "seed, workload, encoders",
    [(s, "qwen2vl-dynamic", ["qwen2.5-vl-vision"]) for s in range(3)]
    + [(s, "vision-audio", ["qwen2.5-vl-vision", "whisper-large-v3-encoder"]) for s in range(2)],
)
def test_light_work_compiled_equals_numpy(seed, workload, encoders):
    """The light work laid on the fluid profile (``light_work.lay_light_work``: the compiled
    probes and deals, on the work alone and on every module, against numpy's), on batches
    where it moves samples, under token and patch caps of 3 mean microbatches; with two
    encoders the deal by module fills four columns and the work."""
    from entrain_data.assignment import entrain as en

    spec = ModelSpec.from_names(encoders, "llama-3.2-1b")
    costs = per_sample_costs(synthesize(workload, 512, seed=seed), spec)
    enc, llm, tok = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens
    pt = costs.encoder_tokens.astype(np.int64)
    dp, m = 4, 32
    kw = dict(dp=dp, microbatches=m, seed=seed, pipeline_stages=4, encoder_patches=pt)
    kw.update(max_tokens=int(max(tok.max(), 3 * tok.sum() / (dp * m))))
    kw.update(max_encoder_patches=int(max(pt.max(), 3 * pt.sum() / (dp * m))))
    moved = []
    real = en.lay_light_work

    def spy(rp, e, lo, stage, cur, rng):
        e2, l2 = real(rp, e, lo, stage, cur, rng)
        moved.append(int(((e2 != e) | (l2 != lo)).any(axis=1).sum()))
        return e2, l2

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(en, "lay_light_work", spy)
        numpy_path, compiled_path = _both(lambda: assign(enc, llm, tok, **kw))
    assert _same_sets(numpy_path, compiled_path)
    assert min(moved) > 0  # both runs laid some replica's light work out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tight", [False, True])
@pytest.mark.parametrize("by_module", [False, True])
def test_light_deal_compiled_equals_numpy(seed, tight, by_module):
    """The light samples dealt to a rising and falling share, on the work alone and on every
    module (``light_work._deal``), with and without binding caps."""
    from entrain_data.assignment.light_work import _deal

    rp, work = two_encoder_deal(seed, tight)
    none = np.full(rp.valid.shape, -1)
    share = 1.0 + 0.3 * np.sin(np.linspace(0, np.pi, rp.m))
    share = np.tile(share / share.sum(), (rp.valid.shape[0], 1))
    (e0, l0), (e1, l1) = _both(lambda: _deal(rp, none, none, work, rp.valid, share, by_module))
    assert np.array_equal(e0, e1) and np.array_equal(l0, l1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SHUFFLED)
def test_slot_order_compiled_equals_numpy(seed, dp, m, per, budget, frozen):
    """The swap rounds on shuffled slots (most swaps pay), with and without a binding budget."""
    _, rp, eidx, lidx, *_ = _state(seed, dp, m, per, budget, frozen)
    stage = stage_costs(rp)
    (e0, l0), (e1, l1) = _both(lambda: order_slowest(rp, eidx, lidx, stage))
    assert np.array_equal(e0, e1) and np.array_equal(l0, l1)
