"""Encoder patch cap, opt-in bounded delay and level-1 balance at many replicas (issue 12)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entrain_data.assignment import assign, check_assignment
from entrain_data.assignment.common import rng_for
from entrain_data.assignment.delay import heavy_samples
from entrain_data.assignment.replica_split import norm_columns, split_replicas
from entrain_data.errors import InvalidInput


def _batch(rng, b, e=1, heavy=0.03):
    tokens = rng.integers(50, 1500, b)
    big = rng.random(b) < heavy
    tokens[big] *= 6
    patches = (tokens[:, None] * rng.uniform(2.0, 4.0, (b, e))).astype(np.int64)
    patches *= rng.random((b, e)) < 0.8
    enc = patches * 1e-5 + (patches / 4000.0) ** 2 * 1e-3
    llm = tokens * 1e-4 + (tokens / 1000.0) ** 2 * 1e-3
    return enc, llm, tokens, patches


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    dp=st.integers(1, 4),
    m=st.integers(1, 6),
    extra=st.integers(0, 40),
    e=st.integers(1, 2),
    slack=st.sampled_from([1.0, 1.2, 1.5, 3.0]),
)
def test_patch_cap_holds_on_every_encoder_set(seed, dp, m, extra, e, slack):
    rng = np.random.default_rng(seed)
    b = dp * m + extra
    enc, llm, tok, pt = _batch(rng, b, e)
    pcap = np.maximum(pt.max(axis=0), (slack * pt.sum(axis=0) / (dp * m)).astype(np.int64))
    pcap = np.maximum(pcap, 1)
    try:
        a = assign(
            enc,
            llm,
            tok,
            dp=dp,
            microbatches=m,
            encoder_patches=pt,
            max_encoder_patches=pcap,
            seed=seed,
        )
    except InvalidInput as exc:  # a cap that cannot be met must say so
        assert "max_encoder_patches" in str(exc)
        return
    check_assignment(a, b, tok, None, None, pt, pcap)
    # the checker itself catches a broken cap
    most = np.max([pt[s].sum(axis=0) for row in a.encoder_sets for s in row], axis=0)
    if most.max() > 1:
        with pytest.raises(InvalidInput, match="patches"):
            check_assignment(a, b, tok, None, None, pt, np.maximum(most - 1, 1))


def test_patch_cap_errors_name_the_sample_and_the_field():
    enc, llm, tok, pt = _batch(np.random.default_rng(1), 64)
    i = int(np.argmax(pt[:, 0]))
    cap = int(np.sort(pt[:, 0])[-2])  # only the largest sample is above it
    with pytest.raises(InvalidInput, match=f"sample {i} .*max_encoder_patches={cap}"):
        assign(enc, llm, tok, dp=2, microbatches=4, encoder_patches=pt, max_encoder_patches=cap)
    with pytest.raises(InvalidInput, match="encoder_patches must be"):
        assign(enc, llm, tok, dp=2, microbatches=4, encoder_patches=pt[:10])
    with pytest.raises(InvalidInput, match="needs encoder_patches"):
        assign(enc, llm, tok, dp=2, microbatches=4, max_encoder_patches=100)
    with pytest.raises(InvalidInput, match="max_delay"):
        assign(enc, llm, tok, dp=2, microbatches=4, max_delay=-1)
    with pytest.raises(InvalidInput, match="ages"):
        assign(enc, llm, tok, dp=2, microbatches=4, max_delay=1, ages=np.ones(3, np.int64))


def _run(batches, enc, llm, tok, dp, m, k, seed=0):
    """A run as a caller drives it: carried rows prepended with their age plus one."""
    carried = np.zeros(0, np.int64)
    age = np.zeros(0, np.int64)
    trained, waits = [], {}
    for it, fresh in enumerate(batches):
        rows = np.concatenate([carried, fresh])
        ages = np.concatenate([age, np.zeros(len(fresh), np.int64)])
        a = assign(
            enc[rows],
            llm[rows],
            tok[rows],
            dp=dp,
            microbatches=m,
            seed=seed,
            iteration=it,
            max_delay=k,
            ages=ages,
            flush=it == len(batches) - 1,
        )
        check_assignment(a, len(rows), tok[rows])
        placed = np.setdiff1d(np.arange(len(rows)), a.carried)
        trained.extend(rows[placed].tolist())
        for i in placed:
            waits[int(rows[i])] = int(ages[i])
        carried, age = rows[a.carried], ages[a.carried] + 1
        assert len(carried) == 0 or it < len(batches) - 1
    return trained, waits


def _outliers(rng, b, rate):
    """Rare samples about four mean microbatches heavy among light ones (dp 8, 4 microbatches)."""
    tok = rng.integers(200, 800, b)
    big = rng.random(b) < rate
    tok[big] = rng.integers(8000, 12000, int(big.sum()))
    return (tok * 2)[:, None] * 1e-5, tok * 1e-4, tok


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("mix", ["outliers", "heavy-tail"])
def test_max_delay_trains_every_sample_once_and_waits_at_most_k(k, mix):
    rng = np.random.default_rng(5)
    b, iters = 256, 7
    if mix == "outliers":
        dp, m = 8, 4
        enc, llm, tok = _outliers(rng, b * iters, 0.01)
    else:
        dp, m = 4, 4
        enc, llm, tok, _ = _batch(rng, b * iters, heavy=0.05)
    batches = [np.arange(i * b, (i + 1) * b) for i in range(iters)]
    trained, waits = _run(batches, enc, llm, tok, dp, m, k)
    assert sorted(trained) == list(range(b * iters))  # exactly once, nothing lost
    assert max(waits.values()) <= k
    if k == 0:
        assert max(waits.values()) == 0
    elif mix == "outliers":  # a replica holding one alone is the slowest: they wait (and
        # light samples may ride along with them: the largest sample sets the cap here)
        big = np.array([tok[r] >= 8000 for r in waits])
        waited = np.array([w > 0 for w in waits.values()])
        assert waited[big].mean() > max(0.5, waited[~big].mean())


def test_max_delay_lands_heavy_samples_together_and_is_deterministic():
    rng = np.random.default_rng(3)
    b, dp, m = 256, 8, 4
    enc, llm, tok = _outliers(rng, b, 0.01)
    kw = dict(dp=dp, microbatches=m, max_delay=2, seed=3, iteration=1)
    a = assign(enc, llm, tok, **kw)
    from entrain_data.assignment.common import validate_inputs

    heavy = heavy_samples(validate_inputs(enc, llm, tok, dp, m, None, None))
    assert 0 < heavy.sum() < dp * m
    assert set(a.carried.tolist()) == set(np.flatnonzero(heavy).tolist())
    assert a.to_dict() == assign(enc, llm, tok, **kw).to_dict()
    # once one of them has waited K iterations, all of them land now: one kept back
    # would force the next landing sooner
    ages = np.where(heavy, 1, 0)
    ages[np.flatnonzero(heavy)[0]] = 2
    assert len(assign(enc, llm, tok, ages=ages, **kw).carried) == 0


def test_more_heavy_samples_than_microbatches_land_as_many_in_every_microbatch():
    """Every iteration lands where heavy samples outnumber the microbatches: a multiple of
    their count is placed, the lightest of the rest wait; once one has waited K, all land."""
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.assignment.delay import delayed_samples

    rng = np.random.default_rng(0)
    b, dp, m = 256, 8, 4
    llm = np.ones(b)
    heavy = rng.permutation(b)[:45]  # 45 heavy (share 0.5) against 32 microbatches
    llm[heavy] = rng.uniform(35, 45, len(heavy))
    tok = (llm * 100).astype(np.int64)
    enc = np.full((b, 1), 0.01)
    x = validate_inputs(enc, llm, tok, dp, m, None, None, max_delay=2)
    carried = delayed_samples(x, flush=False, share=0.5)
    assert len(carried) == 45 % (dp * m) and set(carried) <= set(heavy)
    assert llm[carried].max() <= np.sort(llm[heavy])[len(carried) - 1]  # the lightest wait
    ages = np.zeros(b, np.int64)
    ages[heavy[0]] = 2
    forced = validate_inputs(enc, llm, tok, dp, m, None, None, max_delay=2, ages=ages)
    assert len(delayed_samples(forced, flush=False, share=0.5)) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_max_delay_keeps_heavy_samples_where_waiting_does_not_pay(seed):
    """A quarter of the samples several times the others: each is heavier than a mean
    microbatch, but together they are most of the work. Carrying them only moves that work
    to the iteration they land in (slower by more than this one gains): none waits."""
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.assignment.delay import delayed_samples

    rng = np.random.default_rng(seed)
    b, dp, m = 64, 2, 16
    tok = np.where(rng.random(b) < 0.25, rng.integers(3000, 4000, b), rng.integers(300, 900, b))
    enc, llm = (tok * 2)[:, None] * 1e-5, tok * 1e-4
    x = validate_inputs(enc, llm, tok, dp, m, None, None, max_delay=2)
    assert len(delayed_samples(x, flush=False)) > 0  # the heavy rule alone would carry them
    assert len(assign(enc, llm, tok, dp=dp, microbatches=m, max_delay=2).carried) == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 3), rate=st.sampled_from([0.01, 0.05]))
def test_max_delay_never_carries_a_sample_past_k(seed, k, rate):
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.assignment.delay import SHARES

    rng = np.random.default_rng(seed)
    b, dp, m = 128, 4, 4
    enc, llm, tok = _outliers(rng, b, rate)
    ages = rng.integers(0, k + 1, b)
    a = assign(enc, llm, tok, dp=dp, microbatches=m, max_delay=k, ages=ages, seed=seed)
    check_assignment(a, b, tok)
    assert (ages[a.carried] < k).all()
    widest = heavy_samples(validate_inputs(enc, llm, tok, dp, m, None, None), min(SHARES))
    # samples heavy by the widest rule wait, light ones only riding along with them
    assert len(a.carried) == 0 or widest[a.carried].any()


@pytest.mark.parametrize("dp", [4, 128])
def test_level1_balances_every_module_across_many_replicas(dp):
    rng = np.random.default_rng(2)
    b = 64 * dp
    enc, llm, tok, _ = _batch(rng, b, e=2, heavy=0.01)
    w = norm_columns(np.concatenate([enc, llm[:, None]], axis=1))
    members = split_replicas(w, dp, rng_for(0, 0, 1))
    sums = np.stack([w[row[row >= 0]].sum(axis=0) for row in members])
    dev = np.abs(sums / sums.mean(axis=0) - 1).max()
    assert dev < 0.02, dev


def test_level1_evens_the_llm_where_another_module_cannot_get_even():
    """Padded speech: every clip one Whisper window, 0.5% of them two. No split evens the
    window counts at dp 128, and before the polish that module kept every swap from evening
    the LLM (0.9% apart); the polish evens it without moving the windows' extremes."""
    import entrain_data.assignment.replica_split as rs

    rng = np.random.default_rng(3)
    dp, b = 128, 64 * 128
    windows = np.where(rng.random(b) < 0.005, 2.0, 1.0) * (1 + 0.002 * rng.random(b))
    llm = rng.lognormal(0, 0.6, b) * (1 + 0.3 * (windows - 1))  # a longer clip says more
    w = norm_columns(np.stack([windows, llm], axis=1))

    def deviations(members):
        sums = np.stack([w[row[row >= 0]].sum(axis=0) for row in members])
        rel = sums / sums.mean(axis=0) - 1
        return rel.max(axis=0), rel.min(axis=0)

    saved = rs._POLISH_ROUNDS
    rs._POLISH_ROUNDS = 0
    try:
        hi0, lo0 = deviations(split_replicas(w, dp, rng_for(0, 0, 1), microbatches=16))
    finally:
        rs._POLISH_ROUNDS = saved
    hi, lo = deviations(split_replicas(w, dp, rng_for(0, 0, 1), microbatches=16))
    assert hi0[0] > 0.005 and hi0[1] > 0.005  # the windows cannot get even; the LLM was not
    assert hi[1] < 2e-4 and lo[1] > -2e-4
    assert hi[0] <= hi0[0] + rs._POLISH_TOL and lo[0] >= lo0[0] - rs._POLISH_TOL


def test_large_batches_run_the_search_too():
    """No batch-size threshold: at 4096 samples the pipeline search still moves samples."""
    import entrain_data.assignment.pipeline_search as ps

    rng = np.random.default_rng(4)
    enc, llm, tok, _ = _batch(rng, 4096, heavy=0.03)
    kw = dict(dp=16, microbatches=16, seed=2)
    a = assign(enc, llm, tok, **kw)
    saved = ps._ROUNDS
    ps._ROUNDS = 0
    try:
        plain = assign(enc, llm, tok, **kw)
    finally:
        ps._ROUNDS = saved
    check_assignment(a, 4096, tok)
    assert a.to_dict() != plain.to_dict()


def test_fresh_layout_is_the_fresh_samples_module_totals():
    """The proxy's stages are laid out on the iteration's fresh samples (age 0): what is
    carried in or out does not move the plan's stages. Where the fresh samples leave a module
    the batch uses without work, or none is fresh, the whole batch's totals."""
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.assignment.delay import fresh_layout

    enc = np.array([[1.0, 0.0], [2.0, 0.0], [0.5, 3.0], [4.0, 1.0]])
    llm = np.array([1.0, 2.0, 3.0, 8.0])
    tok = np.array([10, 20, 30, 80])

    def layout(ages):
        x = validate_inputs(enc, llm, tok, 1, 2, None, None, max_delay=2, ages=np.array(ages))
        return fresh_layout(x)

    assert np.allclose(layout([0, 0, 0, 1]), [3.5, 3.0, 6.0])
    assert np.allclose(layout([0, 0, 0, 0]), [7.5, 4.0, 14.0])
    assert np.allclose(layout([0, 0, 1, 1]), [7.5, 4.0, 14.0])  # the second encoder: no fresh work
    assert np.allclose(layout([1, 2, 1, 1]), [7.5, 4.0, 14.0])  # nothing fresh


@pytest.mark.parametrize("mix", ["even", "documents"])
def test_max_delay_changes_nothing_where_nothing_waits(mix, monkeypatch):
    """A batch of fresh samples that keeps all of them is assigned as without ``max_delay``:
    with no heavy sample (no option to price), and with heavy documents whose every option
    to carry is priced and refused (an option must be 99.9% cheaper: none is)."""
    from entrain_data.assignment import delay
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.cost_model import per_sample_costs
    from entrain_data.presets import ModelSpec
    from entrain_data.workloads import synthesize

    if mix == "even":  # no sample near a mean microbatch (four samples)
        tok = np.random.default_rng(4).integers(500, 700, 512)
        enc, llm = (tok * 2)[:, None] * 1e-5, tok * 1e-4
    else:
        spec = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-3b")
        c = per_sample_costs(synthesize("text-heavy", 512, seed=2), spec)
        enc, llm, tok = c.encoder_cost(), c.llm_cost(), c.llm_tokens
        monkeypatch.setattr(delay, "GAIN", 0.999)
    kw = dict(dp=4, microbatches=32, pipeline_stages=4, seed=1, iteration=3)
    x = validate_inputs(enc, llm, tok, 4, 32, None, None, max_delay=2, pipeline_stages=4)
    assert (len(delay.delayed_samples(x, flush=False)) > 0) == (mix == "documents")
    a = assign(enc, llm, tok, max_delay=2, **kw)
    assert len(a.carried) == 0
    assert a.to_dict() == assign(enc, llm, tok, **kw).to_dict()


def _fixed_stage_time(a, enc, llm, layout, stages):
    """The run's yardstick: a's iteration time on one 1F1B layout of the modules (``layout``:
    module totals, :func:`.pipeline_search.proxy_stage_shares`), every module trainable (a
    third of its cost forward: an encoder's with its E set, the LLM's with its L set; the
    backward of both with the L set)."""
    from entrain_data.assignment.pipeline_search import proxy_stage_shares
    from entrain_data.simulator import simulate_pipeline

    sh = proxy_stage_shares(layout, stages)  # [S, K]
    e_stage, l_stage = enc @ sh[:, :-1].T, llm[:, None] * sh[:, -1]  # [n, S]
    fwd = np.zeros((a.dp, a.microbatches, stages))
    bwd = np.zeros_like(fwd)
    for r in range(a.dp):
        for j in range(a.microbatches):
            e, lset = a.encoder_sets[r][j], a.llm_sets[r][j]
            fwd[r, j] = (e_stage[e].sum(axis=0) + l_stage[lset].sum(axis=0)) / 3
            bwd[r, j] = 2 * (e_stage[lset].sum(axis=0) + l_stage[lset].sum(axis=0)) / 3
    return simulate_pipeline(fwd, bwd).iteration_time


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_max_delay_does_not_lose_where_heavy_samples_are_most_of_the_work(seed):
    """Long documents heavier than a mean microbatch and much of the LLM's work, a vision and
    an audio encoder beside a 3B LLM on 4 stages: carrying them empties one iteration's LLM
    stages and fills the landing's, and the plan's stages stay where they are. A run of 8
    iterations with ``max_delay=2`` is not slower on one fixed layout than one without
    (priced on a layout that moved with each batch's mix, it ran 5-8% slower here)."""
    from entrain_data.cost_model import per_sample_costs
    from entrain_data.presets import ModelSpec
    from entrain_data.workloads import synthesize

    spec = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-3b")
    b, iters, dp, m = 512, 8, 4, 32
    c = per_sample_costs(synthesize("text-heavy", b * iters, seed=seed), spec)
    enc, llm, tok = c.encoder_cost(), c.llm_cost(), c.llm_tokens
    layout = np.append(enc[:b].sum(axis=0), llm[:b].sum())  # a batch's mix: the plan's stages

    def run(k: int) -> float:
        carried, age, total = np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0
        for it in range(iters):
            rows = np.concatenate([carried, np.arange(it * b, (it + 1) * b)])
            ages = np.concatenate([age, np.zeros(b, np.int64)])
            a = assign(enc[rows], llm[rows], tok[rows], dp=dp, microbatches=m, seed=seed,
                       iteration=it, max_delay=k, ages=ages, flush=it == iters - 1,
                       pipeline_stages=4)  # fmt: skip
            total += _fixed_stage_time(a, enc[rows], llm[rows], layout, 4)
            carried, age = rows[a.carried], ages[a.carried] + 1
        return total

    assert run(2) <= run(0) * 1.005


def _chat_with_documents(rng, n):
    """Short chats (a small image each) and, three in a hundred, a long document about ten
    mean microbatches heavy at 512 / dp 4 / 32: the largest sample sets the token cap."""
    tok = rng.integers(150, 900, n)
    docs = rng.random(n) < 0.03
    tok[docs] = rng.integers(20000, 30000, int(docs.sum()))
    enc = np.where(docs, 0.0, rng.uniform(0.5, 1.5, n) * 4e-3)[:, None]
    llm = tok * 1e-5 + (tok / 4000.0) ** 2 * 2e-4
    return enc, llm, tok, docs


@pytest.mark.parametrize("seed", [0, 1])
def test_light_samples_ride_into_a_landing_where_the_cap_has_room(seed, monkeypatch):
    """Where the largest sample sets the cap, an iteration that carries its documents also
    carries half its light samples (riders): the landing's light work then fills the stall of
    the documents it lands, as WLB-LLM's final flush does. On one fixed layout a run of 8
    iterations is faster than carrying the documents alone; every landing holds the caps."""
    from entrain_data.assignment import delay
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.token_caps import cap_rule

    b, iters, dp, m = 512, 8, 4, 32
    enc, llm, tok, docs = _chat_with_documents(np.random.default_rng(seed), b * iters)
    layout = np.append(enc[:b].sum(axis=0), llm[:b].sum())
    cap = int(tok.max())  # the plan's cap: the largest sample, above 1.5x a mean microbatch
    assert cap > cap_rule(int(tok[:b].sum()) * 2, 0, dp, m)

    def run() -> tuple[float, int]:
        carried, age, total, rode = np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0, 0
        for it in range(iters):
            rows = np.concatenate([carried, np.arange(it * b, (it + 1) * b)])
            ages = np.concatenate([age, np.zeros(b, np.int64)])
            a = assign(enc[rows], llm[rows], tok[rows], dp=dp, microbatches=m, seed=seed,
                       iteration=it, max_delay=2, ages=ages, flush=it == iters - 1,
                       pipeline_stages=4, max_tokens=cap)  # fmt: skip
            check_assignment(a, len(rows), tok[rows], cap)
            x = validate_inputs(enc[rows], llm[rows], tok[rows], dp, m, None, None)
            heavy = heavy_samples(x, min(delay.SHARES))
            assert len(a.carried) == 0 or heavy[a.carried].any()  # riders never ride alone
            rode += int((~heavy[a.carried]).sum())
            total += _fixed_stage_time(a, enc[rows], llm[rows], layout, 4)
            carried, age = rows[a.carried], ages[a.carried] + 1
        return total, rode

    with_riders, rode = run()
    monkeypatch.setattr(delay, "RIDERS", 0.0)
    alone, none_rode = run()
    assert rode > b and none_rode == 0
    assert with_riders < alone * 0.995  # measured 0.982 and 0.988


def test_no_light_sample_rides_where_a_landing_would_need_a_larger_cap():
    """Where 1.5x a mean microbatch sets the cap (no sample near it in tokens; the heavy
    samples are heavy on the encoder), a landing twice a batch could not hold it: only the
    heavy samples wait, with a cap given and without one (the rule's cap for the batch)."""
    from entrain_data.assignment.common import validate_inputs
    from entrain_data.assignment.delay import SHARES

    rng = np.random.default_rng(7)
    b, dp, m = 512, 4, 32
    tok = rng.integers(400, 700, b)
    enc = rng.uniform(0.5, 1.5, b)[:, None] * 1e-3
    big = rng.permutation(b)[:6]
    enc[big] = 0.3  # pages heavier than a mean microbatch on the encoder, tokens as any
    llm = tok * 1e-5
    x = validate_inputs(enc, llm, tok, dp, m, None, None)
    heavy = heavy_samples(x, min(SHARES))
    for cap in (None, int(np.ceil(1.5 * tok.sum() / (dp * m)))):
        a = assign(enc, llm, tok, dp=dp, microbatches=m, max_delay=2, max_tokens=cap,
                   pipeline_stages=4)  # fmt: skip
        assert len(a.carried) > 0 and heavy[a.carried].all()
