"""Several encoders are one encoder load as well as several columns (issue 12).

A vision + speech model whose images are all one resolution and whose clips are padded to
30 s: every sample carries one item of near-constant cost, so the encoders' summed work per
microbatch is a count, which any fixed-count cut keeps even. Balancing each column alone
lets the number of samples per microbatch drift (5 images + 4 clips beside 4 + 3), and the
summed encoder load came out 2-4x less even than ``sequential``'s; entrain balances the sum
as a module of its own (``Replicas.module_costs``).
"""

from __future__ import annotations

import numpy as np
import pytest

from entrain_data.assignment import assign, check_assignment
from entrain_data.metrics import microbatch_loads


def _images_and_clips(seed: int, n: int = 512):
    """Half the samples one fixed-size image, half one padded clip (costs within 10%), a
    lognormal transcript or answer."""
    rng = np.random.default_rng(seed)
    image = rng.random(n) < 0.5
    enc = np.zeros((n, 2))
    cost = rng.uniform(0.9, 1.1, n)
    enc[image, 0] = cost[image]
    enc[~image, 1] = cost[~image]
    llm = rng.lognormal(0.0, 0.6, n)
    return enc, llm, (llm * 300).astype(np.int64) + 1


@pytest.mark.parametrize("dp,m,stages", [(4, 16, 4), (8, 8, 2), (8, 8, 1), (16, 16, 8)])
def test_summed_encoder_load_stays_below_sequential(dp, m, stages):
    # before the sum was a module: 0.038-0.071 against sequential's 0.018-0.021 at 4 / 16
    for seed in range(4):
        enc, llm, tok = _images_and_clips(seed)
        kw = dict(dp=dp, microbatches=m, seed=0, pipeline_stages=stages)
        a = assign(enc, llm, tok, **kw)
        check_assignment(a, len(llm), tok, None, None)
        cv = microbatch_loads(a, enc, llm).cv()
        seq = microbatch_loads(assign(enc, llm, tok, method="sequential", **kw), enc, llm).cv()
        for module in ("encoder", "encoder0", "encoder1", "llm"):
            assert cv[module] < seq[module], (seed, module, cv[module], seq[module])


def test_an_encoder_without_work_changes_nothing():
    # a vision + audio model on an image-only batch: the idle audio column is no module
    rng = np.random.default_rng(3)
    n = 256
    vision = rng.lognormal(0.0, 0.8, n)
    llm = rng.lognormal(0.0, 0.6, n)
    tok = (llm * 300).astype(np.int64) + 1
    kw = dict(dp=4, microbatches=8, seed=2, pipeline_stages=4)
    one = assign(vision, llm, tok, **kw)
    two = assign(np.stack([vision, np.zeros(n)], axis=1), llm, tok, **kw)
    for r in range(4):
        for j in range(8):
            assert one.encoder_sets[r][j].tolist() == two.encoder_sets[r][j].tolist()
            assert one.llm_sets[r][j].tolist() == two.llm_sets[r][j].tolist()
