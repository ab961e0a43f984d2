"""The slowest replica sets the iteration (issue 12): level 1 evens replicas to the last
0.001%, and a replica slower than the others can be takes a less even candidate whose CVs
stay well below a random cut's (``entrain._stragglers``)."""

from __future__ import annotations

import numpy as np
import pytest

import entrain_data.assignment.entrain as entrain_mod
from entrain_data.assignment import assign, check_assignment, validate_inputs
from entrain_data.assignment.replica_split import split_replicas
from entrain_data.metrics import microbatch_loads
from entrain_data.simulator import simulate_pipeline, times_from_sample_costs


def _counted_clips(seed: int, n: int = 2048):
    """Audio clips padded to 30 s windows (encoder work a count, a long clip six windows)
    with a heavy-tailed transcript: common-voice-like."""
    rng = np.random.default_rng(seed)
    enc = np.ones(n)
    enc[rng.random(n) < 0.02] *= 6
    llm = rng.lognormal(0, 0.7, n)
    llm[rng.random(n) < 0.004] *= 20
    return enc, llm, (llm * 400).astype(np.int64) + 1


def _iteration(a, enc, llm) -> float:
    """1F1B time on 4 stages: the encoder in thirds on stages 0-2, the LLM on stage 3; a
    third of a module's cost forward, two thirds backward (the encoder's runs with L)."""
    f = np.zeros((a.dp, a.microbatches, 4))
    b = np.zeros_like(f)
    for r in range(a.dp):
        for j in range(a.microbatches):
            e, lset = a.encoder_sets[r][j], a.llm_sets[r][j]
            f[r, j, :3] = enc[e].sum() / 9
            b[r, j, :3] = 2 * enc[lset].sum() / 9
            f[r, j, 3] = llm[lset].sum() / 3
            b[r, j, 3] = 2 * llm[lset].sum() / 3
    return simulate_pipeline(f, b).iteration_time


def test_straggling_replicas_take_faster_candidates_and_balance_stays(monkeypatch):
    # measured over seeds 0-7: 1.6-3.1% shorter on five, unchanged on the three where one
    # transcript outweighs a microbatch (no candidate moves that replica's time); never
    # longer. Without the rule the deferring sets pile the encoder's backward into the
    # last L sets of the slowest replicas
    dp, m = 8, 16
    on, off = [], []
    for seed in range(8):
        enc, llm, tok = _counted_clips(seed)
        kw = dict(dp=dp, microbatches=m, defer_budget=int(2 * tok.sum() / (dp * m)), seed=1)
        a = assign(enc, llm, tok, **kw)
        check_assignment(a, len(llm), tok, None, kw["defer_budget"])
        on.append(_iteration(a, enc, llm))
        seq = microbatch_loads(assign(enc, llm, tok, method="sequential", **kw), enc, llm).cv()
        cv = microbatch_loads(a, enc, llm).cv()
        for module in ("encoder", "llm"):
            assert cv[module] < seq[module], (seed, module, cv[module], seq[module])
        with monkeypatch.context() as mp:
            mp.setattr(entrain_mod, "_stragglers", _rule_off)
            off.append(_iteration(assign(enc, llm, tok, **kw), enc, llm))
    assert all(x <= y * (1 + 1e-6) for x, y in zip(on, off)), (on, off)
    assert sum(on) < 0.99 * sum(off), (on, off)


def _rule_off(rp, scored, loads, keys, pick, best_key, price):
    """``entrain._stragglers`` that keeps every replica's pick."""
    return pick, best_key


def _slowest_proxy(enc, llm, tok, dp, m) -> float:
    """The slowest replica's proxy 1F1B time of entrain's assignment (4 stages)."""
    budget = int(2 * tok.sum() / (dp * m))
    x = validate_inputs(enc, llm, tok, dp, m, None, budget, pipeline_stages=4)
    return float(entrain_mod.assign_entrain_priced(x, seed=1, iteration=0)[1].max())


def test_a_module_no_candidate_evens_does_not_stop_the_rule(monkeypatch):
    # clips padded to 30 s windows, one in a hundred two windows long, 4 samples a
    # microbatch: a replica holding 33 windows in 8 sets has one set of 5, whatever the
    # candidate, so its encoder CV (0.08) is above 3/4 of a random cut's and no candidate
    # passed the rule's bound; its deferring sets piled the encoder's backward into the
    # last L set (2.25x a mean one) and that replica ran 9% slower than joint sets do
    # (seed 5). A module's bound is now at least the lowest CV any usable candidate has
    dp, m = 16, 8
    for seed in range(10):
        rng = np.random.default_rng(seed)
        enc = np.where(rng.random(dp * m * 4) < 0.01, 2.0, 1.0)
        llm = rng.lognormal(0, 0.5, len(enc))
        tok = (llm * 300).astype(np.int64) + 1
        on = _slowest_proxy(enc, llm, tok, dp, m)
        with monkeypatch.context() as mp:
            mp.setattr(entrain_mod, "_stragglers", _rule_off)
            off = _slowest_proxy(enc, llm, tok, dp, m)
        assert on <= off * (1 + 1e-9), (seed, on, off)
        if seed == 5:  # 24.83 against 27.21 proxy units before the search's outlier room
            assert on < 0.97 * off, (on, off)  # (pipeline_search.outliers), 25.88 since


@pytest.mark.parametrize("dp", [4, 16, 128])
def test_level_one_evens_replica_sums_where_encoder_work_is_a_count(dp):
    # every clip one 30 s window: equal counts even the encoder, and the replicas' LLM sums
    # can match to the last 0.001% (verl's Karmarkar-Karp does); an iteration waits for
    # the heaviest replica, so a 0.2% spread costs 0.2% of every iteration
    rng = np.random.default_rng(dp)
    b = 64 * dp
    w = np.stack([np.ones(b), rng.lognormal(0, 0.35, b)], axis=1)
    w = w / w.mean(axis=0)
    members = split_replicas(w, dp, np.random.default_rng(0))
    sums = np.stack([w[r[r >= 0]].sum(axis=0) for r in members])
    spread = np.abs(sums / sums.mean(axis=0) - 1).max()
    assert spread < 1e-4, spread


def test_replicas_within_the_searchs_gain_of_the_slowest_take_faster_candidates(monkeypatch):
    # fixed-resolution images at 8192 / dp 128, told 4 stages, run on the bench's 4-stage
    # layout. The pick's floor was the slowest replica's best reach, and a replica a little
    # faster kept its deferring sets, which a pass of the search (4 moves a round among 32
    # replicas) barely moves, while the search brought the slowest below it: it then set
    # the iteration. Over seeds 0-6: 0.24-0.50% shorter on five, 0.04% and 0.28% longer on
    # two (seeds 0, 1)
    from test_assignment_pick import workload_on_stages

    on, off = [], []
    for seed in range(7):
        costs, per_stage = workload_on_stages("llava-fixed", ["qwen2.5-vl-vision"], 8192, seed)
        enc, llm, tok = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens
        kw = dict(dp=128, microbatches=16, seed=0, pipeline_stages=4)
        a = assign(enc, llm, tok, **kw)
        on.append(simulate_pipeline(*times_from_sample_costs(a, per_stage)).iteration_time)
        seq = microbatch_loads(assign(enc, llm, tok, method="sequential", **kw), enc, llm).cv()
        cv = microbatch_loads(a, enc, llm).cv()
        for module in ("encoder", "llm"):
            assert cv[module] < seq[module], (seed, module, cv[module], seq[module])
        with monkeypatch.context() as mp:
            mp.setattr(entrain_mod, "_SEARCH_GAIN", 0.0)
            b = assign(enc, llm, tok, **kw)
        off.append(simulate_pipeline(*times_from_sample_costs(b, per_stage)).iteration_time)
    assert all(x <= y * 1.004 for x, y in zip(on, off)), (on, off)
    assert sum(on) < 0.998 * sum(off), (on, off)


def test_with_no_more_replicas_than_the_search_focus_the_floor_is_the_slowest_reach(monkeypatch):
    # every replica gets the whole search there: the margin is the share of replicas a pass
    # leaves out, none (at 512 / dp 4 a 0.5% margin took the encoder CV from 6.3x below
    # sequential's to 5.0x for no time the balance bench could measure)
    rng = np.random.default_rng(0)
    enc, tok = rng.lognormal(0, 0.5, 512), rng.integers(200, 3000, 512)
    llm = tok * 1e-4
    for dp, m in ((4, 32), (32, 4)):
        a = assign(enc, llm, tok, dp=dp, microbatches=m)
        with monkeypatch.context() as mp:
            mp.setattr(entrain_mod, "_SEARCH_GAIN", 0.0)
            b = assign(enc, llm, tok, dp=dp, microbatches=m)
        assert a.to_dict() == b.to_dict()
