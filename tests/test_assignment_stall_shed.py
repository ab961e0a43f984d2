"""A replica whose pipeline stalls gives work to the fastest ones (issue 12).

A sample several times a mean microbatch stalls 1F1B wherever it sits, so the replica that
holds it runs longer than one with the same module sums. Level 1 evens the sums;
:func:`entrain_data.assignment.stall_shed.shed_stalls` then moves the stalled replicas'
other samples to the replicas with room, rebuilds the givers' sets and keeps the result only
where the slowest replica is faster and no module's batch-wide CV passes its limit.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from entrain_data.assignment import assign, check_assignment, stall_shed
from entrain_data.assignment import entrain as entrain_module
from entrain_data.assignment.common import validate_inputs
from entrain_data.assignment.entrain import assign_entrain_priced
from entrain_data.metrics import microbatch_loads


def _transcripts(rng, n, monsters, dp, m, size=6.0):
    """Every sample one clip of speech and a transcript; ``monsters`` transcripts carry six
    mean microbatches of LLM work each. (Where every clip costs the same, a replica that
    gives clips away makes its encoder sets uneven where any cut keeps them even: no
    shedding then, as no shaping.)"""
    enc = rng.lognormal(0, 0.3, n)
    llm = rng.lognormal(0, 0.4, n)
    llm[:monsters] = size * llm[monsters:].sum() / (dp * m)
    tok = (llm * 40).astype(np.int64) + 8
    return enc, llm, tok


# random batches of transcripts with a few monsters, for the property tests
_BATCHES = dict(
    seed=st.integers(0, 10_000),
    dp=st.sampled_from([8, 16, 32]),
    m=st.sampled_from([8, 16]),
    monsters=st.integers(1, 4),
    size=st.sampled_from([2.0, 3.0, 4.0, 6.0]),
    frozen=st.booleans(),
)


def _priced(enc, llm, tok, dp, m):
    x = validate_inputs(enc, llm, tok, dp, m, None, None, frozen_encoders=True, pipeline_stages=4)
    return assign_entrain_priced(x, 0, 1)


def test_a_stalled_replica_gives_its_other_work_away(monkeypatch):
    rng = np.random.default_rng(0)
    dp, m = 32, 16
    enc, llm, tok = _transcripts(rng, dp * m * 4, 2, dp, m, size=4.0)
    a, t = _priced(enc, llm, tok, dp, m)
    monkeypatch.setattr(stall_shed, "_STALL", np.inf)  # never shed
    a0, t0 = _priced(enc, llm, tok, dp, m)
    assert t.max() < 0.9 * t0.max(), (t.max(), t0.max())  # measured 0.856
    counts = [sum(len(s) for s in row) for row in a.llm_sets]
    holders = [r for r, row in enumerate(a.llm_sets) if any(np.isin(s, [0, 1]).any() for s in row)]
    others = np.median(counts)
    assert all(counts[r] < others for r in holders), (counts, holders)  # they hold fewer samples
    assert [sum(len(s) for s in row) for row in a0.llm_sets] == [4 * m] * dp  # level 1 alone
    check_assignment(a, len(llm), tok)
    # balance stays the contract: both modules stay more even than sequential's cut
    cv = microbatch_loads(a, enc, llm).cv()
    seq = assign(enc, llm, tok, dp=dp, microbatches=m, method="sequential")
    cv_seq = microbatch_loads(seq, enc, llm).cv()
    assert cv["encoder"] < cv_seq["encoder"] and cv["llm"] < cv_seq["llm"], (cv, cv_seq)


def test_nothing_moves_where_no_replica_stalls(monkeypatch):
    rng = np.random.default_rng(1)
    dp, m = 16, 8
    enc = rng.lognormal(0, 0.3, dp * m * 4)
    llm = rng.lognormal(0, 0.3, dp * m * 4)
    tok = (llm * 40).astype(np.int64) + 8
    kw = dict(dp=dp, microbatches=m, pipeline_stages=4, seed=0, iteration=1)
    a = assign(enc, llm, tok, **kw)
    monkeypatch.setattr(stall_shed, "_STALL", np.inf)
    assert a.to_dict() == assign(enc, llm, tok, **kw).to_dict()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_BATCHES)
# a receiver with pads: its new sample once kept a pad's stale set and broke the patch cap
@example(seed=1717, dp=32, m=8, monsters=1, size=2.0, frozen=False)
def test_every_sample_once_and_caps_kept_when_work_moves(seed, dp, m, monsters, size, frozen):
    rng = np.random.default_rng(seed)
    n = dp * m * 3 + int(rng.integers(0, dp))
    enc, llm, tok = _transcripts(rng, n, monsters, dp, m, size)
    patches = (enc * 100).astype(np.int64)[:, None] + 1
    cap = int(max(tok.max(), 1.5 * tok.sum() / (dp * m)))
    pcap = int(max(patches.max(), 1.5 * patches.sum() / (dp * m)))
    kw = dict(dp=dp, microbatches=m, max_tokens=cap, encoder_patches=patches)
    kw.update(max_encoder_patches=pcap, frozen_encoders=frozen, pipeline_stages=4)
    a = assign(enc, llm, tok, seed=seed, iteration=1, **kw)
    check_assignment(a, n, tok, cap, None, patches, np.array([pcap]))
    b = assign(enc, llm, tok, seed=seed, iteration=1, **kw)
    assert a.to_dict() == b.to_dict()  # deterministic


def test_plain_data_parallelism_never_sheds():
    rng = np.random.default_rng(2)
    dp, m = 16, 4
    enc, llm, tok = _transcripts(rng, dp * m * 4, 2, dp, m)
    a = assign(enc, llm, tok, dp=dp, microbatches=m, pipeline_stages=1, seed=0, iteration=1)
    assert [sum(len(s) for s in row) for row in a.llm_sets] == [4 * m] * dp


def _with_builds(seed, dp, m, monsters, size, frozen, early=True):
    """(assignment as a dict, level-2 builds) with or without the checks that turn a share
    away before its givers' sets are built."""
    rng = np.random.default_rng(seed)
    n = dp * m * 3 + int(rng.integers(0, dp))
    enc, llm, tok = _transcripts(rng, n, monsters, dp, m, size)
    builds = []
    candidates = entrain_module._candidates
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(entrain_module, "_candidates", lambda *a: builds.append(1) or candidates(*a))
        if not early:
            mp.setattr(stall_shed, "_fails_early", lambda *a: False)
        a = assign(
            enc, llm, tok, dp=dp, microbatches=m, frozen_encoders=frozen, pipeline_stages=4,
            seed=seed, iteration=1,
        )  # fmt: skip
    return a.to_dict(), len(builds) - 1  # the first build is level 2 itself


def test_a_share_that_cannot_be_kept_costs_no_level_2():
    # three stalled replicas, every share breaks the CV limit: 3 builds were thrown away
    assert _with_builds(0, 16, 8, 3, 6.0, False, early=False)[1] == 3
    assert _with_builds(0, 16, 8, 3, 6.0, False)[1] == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_BATCHES)
def test_the_early_checks_change_no_outcome(seed, dp, m, monsters, size, frozen):
    early, builds = _with_builds(seed, dp, m, monsters, size, frozen)
    late, late_builds = _with_builds(seed, dp, m, monsters, size, frozen, early=False)
    assert early == late
    assert builds <= late_builds


def _slowest(enc, llm, tok, dp, m, passes, monkeypatch) -> float:
    monkeypatch.setattr(entrain_module, "_SHED_PASSES", passes)
    return float(_priced(enc, llm, tok, dp, m)[1].max())


def test_the_next_stalled_replica_gives_too(monkeypatch):
    """One round gave the slowest replicas' work away and stopped, though the next slowest
    stalled as well (4 transcripts of 4 mean microbatches on 32 replicas: 3% slower)."""
    rng = np.random.default_rng(34)
    dp, m = 32, 16
    enc, llm, tok = _transcripts(rng, dp * m * 4, 4, dp, m, size=4.0)
    passes = entrain_module._SHED_PASSES
    once = _slowest(enc, llm, tok, dp, m, 1, monkeypatch)
    again = _slowest(enc, llm, tok, dp, m, passes, monkeypatch)
    assert again < 0.99 * once, (again, once)  # measured 0.969


def _rounds(enc, llm, tok, dp, m, frozen, seed):
    """(slowest replica with one round, with three, the final CVs [encoder, LLM], the bound
    of the sets before any shedding) of one batch."""
    x = validate_inputs(
        enc, llm, tok, dp, m, None, None, frozen_encoders=frozen, pipeline_stages=4
    )  # fmt: skip
    seen = []
    first = stall_shed.shed_stalls

    def shed(x, rp, eidx, lidx, *rest):
        seen.append(stall_shed.cv_limit(rp, eidx, lidx))  # the bound of the sets it is given
        return first(x, rp, eidx, lidx, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(entrain_module, "_SHED_PASSES", 1)
        once = assign_entrain_priced(x, seed, 1)[1].max()
        mp.setattr(entrain_module, "shed_stalls", shed)
        mp.setattr(entrain_module, "_SHED_PASSES", 3)
        a, t = assign_entrain_priced(x, seed, 1)
    cv = microbatch_loads(a, enc, llm).cv()
    return once, t.max(), np.array([cv["encoder"], cv["llm"]]), seen[0]


def test_rounds_keep_the_first_rounds_balance_bound():
    """Each round took its CV slack again from the last round's sets: the LLM CV ended 13%
    above the sets' before any shedding, where the bound is 10% (the second review's case)."""
    rng = np.random.default_rng(5)
    _transcripts(rng, 32 * 16 * 4, 4, 32, 16, 4.0)  # the case came second from its generator
    enc, llm, tok = _transcripts(rng, 16 * 8 * 4, 3, 16, 8, 3.0)
    once, again, cv, bound = _rounds(enc, llm, tok, 16, 8, False, 5)
    assert again <= once and (cv <= bound + 1e-9).all(), (cv, bound)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_BATCHES)
def test_more_rounds_never_slower_nor_past_the_bound(seed, dp, m, monsters, size, frozen):
    rng = np.random.default_rng(seed)
    enc, llm, tok = _transcripts(rng, dp * m * 3, monsters, dp, m, size)
    once, again, cv, bound = _rounds(enc, llm, tok, dp, m, frozen, seed)
    assert again <= once + 1e-9 * once
    assert (cv <= bound + 1e-9).all(), (cv, bound)


def test_padded_speech_sheds_only_where_delay_is_opted_into():
    """Whisper pads every clip to 30 s, so a replica that gives clips away has lighter
    encoder sets than any equal-count cut: plain entrain keeps its sets (balance is its
    contract) and stalls. ``max_delay > 0`` trades the iteration's sample set for time
    already, and its landings hold every heavy sample carried so far: there the stalled
    replicas give their work away whatever it does to the encoder CV (frozen
    common-voice-ps at 8192 / dp 128: 0.986 -> 1.028 of ``wlb_llm``)."""
    rng = np.random.default_rng(3)
    dp, m = 32, 16
    _, llm, tok = _transcripts(rng, dp * m * 4, 3, dp, m, size=4.0)
    enc = np.ones(len(llm))  # every clip padded to the same length
    kw = dict(dp=dp, microbatches=m, frozen_encoders=True, pipeline_stages=4, iteration=1)
    plain = assign(enc, llm, tok, **kw)
    landing = assign(enc, llm, tok, max_delay=2, flush=True, **kw)  # everything placed
    assert [sum(len(s) for s in row) for row in plain.llm_sets] == [4 * m] * dp
    counts = [sum(len(s) for s in row) for row in landing.llm_sets]
    assert min(counts) < 4 * m < max(counts), counts  # stalled replicas gave work away
    check_assignment(landing, len(llm), tok)
    assert len(landing.carried) == 0

    def slowest(max_delay):
        x = validate_inputs(enc, llm, tok, dp, m, None, None, max_delay=max_delay,
                            frozen_encoders=True, pipeline_stages=4)  # fmt: skip
        return float(assign_entrain_priced(x, 0, 1)[1].max())

    assert slowest(2) < 0.95 * slowest(0), (slowest(2), slowest(0))


def test_with_delay_a_replica_a_few_percent_over_the_mean_gives_work(monkeypatch):
    """Where delay is opted into, the landings' slowest replicas ran 2.5-3% over the mean and,
    under the 5% rule, gave nothing (frozen common-voice-ps at 4096 / dp 16)."""
    rng = np.random.default_rng(0)
    dp, m = 16, 16
    _, llm, tok = _transcripts(rng, dp * m * 4, 3, dp, m, size=2.0)
    enc = np.ones(len(llm))
    x = validate_inputs(enc, llm, tok, dp, m, None, None, max_delay=2, frozen_encoders=True,
                        pipeline_stages=4)  # fmt: skip
    t = assign_entrain_priced(x, 0, 1)[1]
    monkeypatch.setattr(stall_shed, "_STALL_DELAYED", stall_shed._STALL)
    t0 = assign_entrain_priced(x, 0, 1)[1]
    assert 1.01 < t0.max() / t0.mean() < 1 + stall_shed._STALL  # measured 1.040
    assert t.max() < 0.99 * t0.max(), (t.max(), t0.max())  # measured 0.982
