"""Shared adapter mechanics: loss sums and counts, scale factors, the encoder-output buffer."""

from __future__ import annotations

import pytest
import torch
from _dist import global_batches, make_model, one_thread, replica_microbatches
from entrain_data.adapters.common import (
    EncoderOutputBuffer,
    global_loss_count,
    group_iterations,
    loss_scale,
    loss_sums,
    loss_units,
)
from entrain_data.adapters.reference_model import pack_microbatch

from entrain_data.batch import Microbatch
from entrain_data.errors import InvalidInput

_one_thread = pytest.fixture(autouse=True)(one_thread)


def test_loss_sums_token_and_sample() -> None:
    logits = torch.randn(7, 5)
    labels = torch.tensor([1, 2, -100, 3, -100, -100, 4])
    cu = torch.tensor([0, 3, 6, 7], dtype=torch.int32)
    tok = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    s, n = loss_sums(logits, labels, cu, "token")
    assert int(n) == 4 and torch.isclose(s, tok[labels != -100].sum())
    s, n = loss_sums(logits, labels, cu, "sample")
    want = (tok[0] + tok[1]) / 2 + tok[3] + tok[6]
    assert int(n) == 3 and torch.isclose(s, want)
    with pytest.raises(InvalidInput, match="loss mode"):
        loss_sums(logits, labels, cu, "batch")


def test_units_and_count_without_distributed() -> None:
    mbs = replica_microbatches(global_batches(1)[0], 0, 1, 3)[0]
    assert [loss_units(mb) for mb in mbs] == [mb.num_loss_tokens for mb in mbs]
    assert global_loss_count(mbs) == sum(mb.num_loss_tokens for mb in mbs)
    assert global_loss_count(mbs, "sample") == sum(len(mb.llm_keys) for mb in mbs)
    assert loss_scale(200, dp=2, accumulation=4) == pytest.approx(8 / 200)
    with pytest.raises(InvalidInput, match="no loss tokens"):
        loss_scale(0)


def test_split_microbatches_sum_to_whole_batch() -> None:
    """Loss sums of balanced microbatches (with deferral) add up to the whole batch's."""
    batch = global_batches(1)[0]
    model = make_model()
    samples = {s.key: s for s in batch}
    whole_sum, whole_n = model(pack_microbatch(samples, list(samples), list(samples)))
    buffer = EncoderOutputBuffer()
    total, n = 0.0, 0
    for rep in replica_microbatches(batch, 0, 2, 3):
        for mb in rep:
            s, c = model(mb, buffer)
            total, n = total + float(s), n + int(c)
    buffer.check_drained(0)
    assert n == int(whole_n) and total == pytest.approx(float(whole_sum), rel=1e-5)


def test_buffer_split_backward_runs_with_consumer() -> None:
    """A deferred sample's encoder gradient arrives only when its consumer runs backward."""
    batch = global_batches(1)[0]
    samples = {s.key: s for s in batch}
    heavy = next(s.key for s in batch if s.patches.shape[0] > 0)
    rest = [k for k in samples if k != heavy]
    model = make_model()
    first = pack_microbatch(samples, list(samples), rest, microbatch=0)
    second = pack_microbatch(samples, [], [heavy], microbatch=1)
    buffer = EncoderOutputBuffer(budget=10_000)
    s0, _ = model(first, buffer)
    assert heavy in buffer and buffer.tokens == samples[heavy].encoder_tokens
    s0.backward()
    g0 = model.vision.embed.weight.grad.clone()
    s1, _ = model(second, buffer)
    assert len(buffer) == 0
    s1.backward()
    assert not torch.equal(model.vision.embed.weight.grad, g0)  # the deferred part arrived


def test_deferred_samples_share_an_encoder_call_per_consumer() -> None:
    """With ``expect``, deferred samples bound for one microbatch are encoded in one call;
    losses and gradients equal one call per sample, and every graph's backward runs once."""
    batch = global_batches(1)[0]
    samples = {s.key: s for s in batch}
    media = [s.key for s in batch if s.patches.shape[0] > 0 or s.audio.shape[0] > 0][:6]
    assert len(media) == 6
    rest = [k for k in samples if k not in media]
    mbs = [
        pack_microbatch(samples, media + rest, rest, microbatch=0),
        pack_microbatch(samples, [], media[:3], microbatch=1),
        pack_microbatch(samples, [], media[3:], microbatch=2),
    ]
    grads, calls = [], []
    for announce in (False, True):
        model = make_model()
        n_calls = [0]

        def count(*_, n_calls=n_calls):
            n_calls[0] += 1

        model.vision.register_forward_hook(count)
        buffer = EncoderOutputBuffer()
        if announce:
            buffer.expect(mbs)
        for mb in mbs:
            loss, _ = model(mb, buffer)
            loss.backward()
        buffer.check_drained(0)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        calls.append(n_calls[0])
    assert calls[1] < calls[0]
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_buffer_budget_iteration_and_frozen() -> None:
    buf = EncoderOutputBuffer(budget=10)
    buf.put("a", torch.zeros(6, 4, requires_grad=True) * 2, iteration=0)
    with pytest.raises(InvalidInput, match="defer budget 10"):
        buf.put("b", torch.zeros(5, 4), iteration=0)
    with pytest.raises(InvalidInput, match="already buffered"):
        buf.put("a", torch.zeros(1, 4))
    with pytest.raises(InvalidInput, match="consumed in iteration 1"):
        buf.pop("a", iteration=1)
    with pytest.raises(InvalidInput, match="never encoded"):
        buf.pop("zz", iteration=0)
    frozen = torch.ones(3, 4)
    buf2 = EncoderOutputBuffer()
    buf2.put("f", frozen)
    with pytest.raises(InvalidInput, match="not consumed"):
        buf2.check_drained(0)
    out = buf2.pop("f")
    assert out.grad_fn is None and not out.requires_grad and buf2.peak_tokens == 3


def test_group_iterations() -> None:
    mbs = [mb for it in range(2) for mb in replica_microbatches(global_batches(2)[it], it, 1, 3)[0]]
    groups = list(group_iterations(iter(mbs)))
    assert [len(g) for g in groups] == [3, 3]
    assert [g[0].iteration for g in groups] == [0, 1]


def _video_microbatches() -> list[Microbatch]:
    """Sample "v" (one video clip, no image) encoded in microbatch 0, consumed in 1; "t" text."""

    def ids(*x: int) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    cu = torch.tensor([0, 3], dtype=torch.int32)
    mb0 = Microbatch(0, 0, 0, 0, ["v", "t"], ["t"], {
        "input_ids": ids(5, 6, 7), "labels": ids(6, 7, -100), "position_ids": ids(0, 1, 2),
        "cu_seqlens": cu, "pixel_values_videos": torch.zeros(4, 12),
        "video_grid_thw": ids(1, 2, 2).reshape(1, 3), "video_sample": ids(0),
    })  # fmt: skip
    mb1 = Microbatch(0, 0, 1, 0, [], ["v"], {
        "input_ids": ids(1, 1, 1), "labels": ids(-100, 5, -100), "position_ids": ids(0, 1, 2),
        "cu_seqlens": cu,
    })  # fmt: skip
    return [mb0, mb1]


def test_video_items_are_vision_calls() -> None:
    """The loader service counts video clips as the vision encoder's items; the adapters'
    all-reduce fallback and the encoder-call check must agree with it."""
    import numpy as np
    from entrain_data.adapters.common import local_call_groups, resolve_encoder_calls
    from entrain_data.adapters.encoding import encode_uniform

    from entrain_data.assignment import Assignment
    from entrain_data.encoder_calls import ENCODER_CALLS_KEY, encoder_calls

    mbs = _video_microbatches()
    assert local_call_groups(mbs, ["vision", "audio"])[0, 1].tolist() == [1, 0]
    fallback = resolve_encoder_calls(mbs)
    a = Assignment(
        "entrain", 1, 2, [[np.array([0, 1]), np.array([], dtype=np.int64)]],
        [[np.array([1]), np.array([0])]],
    )  # fmt: skip
    uses = {"vision": np.array([True, False]), "audio": np.array([False, False])}
    service = encoder_calls(a, uses)[0]
    assert fallback[0].meta[ENCODER_CALLS_KEY] == service
    buffer = EncoderOutputBuffer()
    buffer.expect(mbs)
    with pytest.raises(InvalidInput, match="no vision call for consumer 1.*vision items"):
        encode_uniform(make_model(), mbs[0], buffer, {"vision": [0], "audio": []})
