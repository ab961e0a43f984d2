"""Joint sets above a cap are repaired by exchanges, not dropped (issue 12).

Balanced joint sets (E == L) weigh tokens as one column among several; a replica holding the
batch's longest transcripts could end one set above the token cap, and the whole candidate was
lost on that replica, with it the fastest sets where the trainable encoder is most of the work.
:func:`entrain_data.assignment.llm_sets.repair_joint` exchanges samples between the fullest set
and the others, the exchange that moves the least work per overflow it removes first.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from entrain_data.assignment.common import slot_sums, validate_inputs
from entrain_data.assignment.entrain import replicas_of
from entrain_data.assignment.llm_sets import fits_cap, repair_joint


def _replicas(enc, llm, tok, dp, m, cap, patches=None, patch_cap=None):
    x = validate_inputs(enc, llm, tok, dp, m, cap, None, patches, patch_cap)
    members = np.arange(len(llm)).reshape(dp, -1)
    return replicas_of(x, members)


def _work(rp):
    return np.concatenate([rp.enc_cols, rp.llm[..., None]], axis=2)


def test_a_set_above_the_token_cap_gives_samples_of_like_work():
    # one replica, 4 sets of 4: set 0 holds a 700-token transcript and three of 150 tokens
    # (1150 > cap 1000), the others 400 tokens each; every sample has one clip, so exchanging
    # a 150 for a 100 three times fits and keeps every set at 4 clips
    tok = np.array([700, 150, 150, 150] + [100] * 12)
    llm = tok / 100.0
    enc = np.ones(16)
    rp = _replicas(enc, llm, tok, 1, 4, 1000)
    bins = np.repeat(np.arange(4), 4)[None, :]
    assert not fits_cap(rp, bins)[0]
    out = repair_joint(rp, bins, _work(rp))
    assert fits_cap(rp, out)[0]
    clips = slot_sums(out, rp.enc_cols[..., 0], rp.valid, 4)[0]
    assert np.allclose(clips, 4.0), clips  # exchanges, not moves: no set lost a clip


def test_a_set_that_only_moves_can_fix_gives_samples_away():
    # set 0: 900 + 3 x 100 tokens, the others 4 x 200: no exchange lowers set 0 without
    # raising another above the cap, so it gives two samples away
    tok = np.array([900, 100, 100, 100] + [200] * 12)
    rp = _replicas(np.ones(16), tok / 100.0, tok, 1, 4, 1000)
    out = repair_joint(rp, np.repeat(np.arange(4), 4)[None, :], _work(rp))
    assert fits_cap(rp, out)[0]


def test_replicas_that_fit_are_untouched_and_patch_caps_count():
    rng = np.random.default_rng(2)
    n, dp, m = 64, 2, 4
    tok = rng.integers(50, 150, n)
    patches = np.full((n, 1), 120)
    patches[32:43] = 290  # replica 1's 11 large images, all in its set 0 below
    rp = _replicas(rng.random(n), rng.random(n), tok, dp, m, 10_000, patches, 2600)
    bins = np.tile(np.repeat(np.arange(m), n // (dp * m)), (dp, 1))
    bins[1, :11] = 0
    bins[1, 11:] = 1 + np.arange(21) % 3
    ok = fits_cap(rp, bins)
    assert ok[0] and not ok[1]
    out = repair_joint(rp, bins, _work(rp))
    assert np.array_equal(out[0], bins[0])
    assert fits_cap(rp, out).all()


def test_one_exchange_that_relieves_the_cap_beats_a_chain_of_slivers():
    # set 0: 700 + 120 + 100 + 100 tokens, 20 over the cap. Set 1 holds a 60-token sample
    # ("a") of nearly the 120's work (LLM work is not proportional to tokens); the other sets
    # hold samples of 109-119 tokens, each a sliver lighter. Exchanging the 120 for "a" fits at
    # once; ranked by work gap alone the repair traded 120 for 119, 119 for 118, ... through
    # every set. It exchanges the one pair, and only those two samples change sets.
    tok = np.array([700, 120, 100, 100, 60] + list(range(109, 120)))
    llm = tok / 100.0
    llm[4] = 1.1  # "a"
    rp = _replicas(np.ones(16), llm, tok, 1, 4, 1000)
    bins = np.repeat(np.arange(4), 4)[None, :]
    out = repair_joint(rp, bins, _work(rp))
    assert fits_cap(rp, out)[0]
    moved = np.flatnonzero(out[0] != bins[0])
    assert moved.tolist() == [1, 4], moved


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.sampled_from([2, 4, 8]), per=st.integers(2, 8))
def test_the_repair_keeps_every_sample_once_and_never_adds_overflow(seed, m, per):
    rng = np.random.default_rng(seed)
    n = m * per
    tok = np.where(rng.random(n) < 0.2, rng.integers(500, 2000, n), rng.integers(10, 200, n))
    cap = int(max(tok.max(), 1.3 * tok.sum() / m))
    rp = _replicas(rng.random((n, 2)), rng.random(n), tok, 1, m, cap)
    bins = rng.integers(0, m, (1, n))
    bins[0, :m] = np.arange(m)  # no empty set to start with
    out = repair_joint(rp, bins, _work(rp))

    def overflow(b):
        t = slot_sums(b, tok[None].astype(float), rp.valid, m)[0]
        return np.maximum(t - cap, 0).sum()

    assert out.shape == bins.shape and ((out >= 0) & (out < m)).all()
    assert overflow(out) <= overflow(bins)
    assert (np.bincount(out[0], minlength=m) > 0).all()  # no set emptied
    if fits_cap(rp, bins)[0]:
        assert np.array_equal(out, bins)
