"""Megatron-Core adapter against the real megatron-core 0.16.1 schedules (CPU, gloo, 2 ranks).

Megatron's schedules allocate their token counter on CUDA; the TEST-ONLY
:mod:`_megatron_shim` (shared with the GPTModel pipeline test) points that and
Megatron's other CUDA-only calls at the CPU inside each test rank. Nothing in
the adapter depends on it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import (
    LR,
    assert_params_close,
    global_batches,
    make_model,
    one_thread,
    reference_params,
    replica_microbatches,
    run_ranks,
)
from torch import nn

from entrain_data.errors import InvalidInput, PlanError
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

pytest.importorskip("megatron.core")

STEPS = 3
MICROBATCHES = 3
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _plan(dp: int, pp: int, layers: list[tuple[int, int]] | None = None) -> ParallelPlan:
    layers = layers or ([(0, 1), (1, 4)] if pp == 2 else [(0, 4)])
    stages = tuple(
        StagePlan(i, (StageSegment("llm", None, a, b, i == 0, i == pp - 1),))
        for i, (a, b) in enumerate(layers)
    )
    return ParallelPlan(
        world_size=dp * pp, gpus_per_node=8, dp=dp, tp=1, pp=pp, stages=stages,
        microbatches=MICROBATCHES, global_batch=16, max_tokens=4096, defer_budget=4096,
    )  # fmt: skip


class _MegatronWrapped(nn.Module):
    """The reference MLLM with the two attributes Megatron's schedules read."""

    def __init__(self, config: object):
        super().__init__()
        from megatron.core.enums import ModelType

        self.mllm = make_model()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor: object) -> None:  # pp=1: nothing comes from a stage before
        pass


def _mcore_rank(rank: int, world: int, out: str) -> None:
    from _megatron_shim import install_cpu_shim
    from entrain_data.adapters.common import EncoderOutputBuffer
    from entrain_data.adapters.megatron import (
        data_iterator,
        finalize_per_token_grads,
        initialize_from_plan,
        make_forward_step,
        max_tokens,
        transformer_settings,
    )
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    install_cpu_shim()
    plan = _plan(dp=world, pp=1)
    initialize_from_plan(plan)
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        assert get_num_microbatches() == MICROBATCHES
        config = TransformerConfig(
            hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
            pipeline_dtype=torch.float32, **transformer_settings(plan),
        )  # fmt: skip
        config.finalize_model_grads_func = finalize_per_token_grads
        model = _MegatronWrapped(config)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        buffer = EncoderOutputBuffer(4096)

        def step(item: dict, m: nn.Module, buf: EncoderOutputBuffer) -> torch.Tensor:
            return m.mllm(item["microbatch"], buf)[0]

        fwd_bwd = get_forward_backward_func()
        for it, batch in enumerate(global_batches(STEPS)):
            mbs = replica_microbatches(batch, it, world, MICROBATCHES)[rank]
            losses = fwd_bwd(
                forward_step_func=make_forward_step(step, buffer=buffer),
                data_iterator=data_iterator(mbs),
                model=[model],
                num_microbatches=len(mbs),
                seq_length=max_tokens(mbs),
                micro_batch_size=1,
            )
            assert len(losses) == MICROBATCHES and int(sum(x["count"] for x in losses)) > 0
            buffer.check_drained(it)
            opt.step()
            opt.zero_grad()
        assert buffer.peak_tokens > 0
        state = {k.removeprefix("mllm."): v.detach().clone() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(state, out)
        _unused_param_step(rank, config, f"{out}.unused.{rank}")
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def mcore_results(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One spawn (dp=2) for the tests below; the path its ranks wrote under."""
    out = tmp_path_factory.mktemp("mcore") / "mcore.pt"
    run_ranks(_mcore_rank, str(out), timeout=180)
    return str(out)


@pytest.mark.timeout(200)
def test_megatron_schedule_balanced_equals_unbalanced(mcore_results: str) -> None:
    """Megatron-Core's forward_backward_func (dp=2) with per-token loss matches one process."""
    assert_params_close(torch.load(mcore_results), reference_params(global_batches(STEPS)))


def test_settings_from_plan() -> None:
    from entrain_data.adapters.megatron import packed_seq_params, transformer_settings
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = transformer_settings(_plan(dp=1, pp=2))
    assert s["variable_seq_lengths"] and s["calculate_per_token_loss"]
    assert (s["num_layers_in_first_pipeline_stage"], s["num_layers_in_last_pipeline_stage"]) == (
        1,
        3,
    )
    cfg = TransformerConfig(
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        **s,
    )  # Megatron's own validation accepts the settings
    assert cfg.num_layers == 4 and cfg.pipeline_model_parallel_size == 2
    mb = replica_microbatches(global_batches(1)[0], 0, 1, MICROBATCHES)[0][0]
    p = packed_seq_params(mb)
    assert p.qkv_format == "thd" and torch.equal(p.cu_seqlens_q, mb["cu_seqlens"])
    assert p.max_seqlen_q == int(torch.diff(mb["cu_seqlens"]).max())
    even = transformer_settings(_plan(dp=1, pp=2, layers=[(0, 2), (2, 4)]))
    assert "num_layers_in_first_pipeline_stage" not in even
    enc = StagePlan(0, (StageSegment("vit", 0, 0, 2, True, True),))
    llm = StagePlan(1, (StageSegment("llm", None, 0, 4, True, True),))
    bad = dataclasses.replace(_plan(dp=1, pp=2), stages=(enc, llm))
    with pytest.raises(PlanError, match="multi-module"):
        transformer_settings(bad)


def test_loss_func_returns_sum_and_count() -> None:
    from entrain_data.adapters.megatron import data_iterator, make_forward_step

    mbs = replica_microbatches(global_batches(1)[0], 0, 1, MICROBATCHES)[0]
    model = make_model()
    fwd = make_forward_step(lambda item, m, buf: m(item["microbatch"], buf)[0])
    it = data_iterator(mbs)
    total, count = 0.0, 0
    for mb in mbs:
        out, loss_func = fwd(it, model)
        loss, n, logged = loss_func(out)
        assert int(n) == mb.num_loss_tokens
        total, count = total + float(loss), count + int(n)
    samples = {s.key: s for s in global_batches(1)[0]}
    from entrain_data.adapters.reference_model import pack_microbatch

    whole = pack_microbatch(samples, list(samples), list(samples))
    loss_sum, n = model(whole)
    assert count == int(n) and abs(total - float(loss_sum)) < 1e-3
    with pytest.raises(InvalidInput, match="loss mode"):
        make_forward_step(lambda *a: None, mode="mean")


@pytest.mark.parametrize("mode", ["token", "sample"])
def test_masked_loss_sum_follows_the_mode(mode: str) -> None:
    """With per-token losses from the model (GPTModel given labels), ``masked_loss_sum`` sums
    what ``make_forward_step`` counts: per-sample means in ``sample`` mode, so Megatron's
    sum(loss_sum) / sum(count) is the global batch's per-sample mean."""
    from entrain_data.adapters.common import loss_sums
    from entrain_data.adapters.megatron import data_iterator, make_forward_step, masked_loss_sum

    mbs = replica_microbatches(global_batches(1)[0], 0, 1, MICROBATCHES)[0]
    torch.manual_seed(0)
    logits = {mb.microbatch: torch.randn(mb.num_tokens, 48) for mb in mbs}

    def step(item: dict, model: object, buf: object) -> torch.Tensor:
        out = logits[item["microbatch"].microbatch]
        return nn.functional.cross_entropy(out, item["labels"][0], reduction="none")[None]

    fwd = make_forward_step(step, mode=mode, loss_sum=masked_loss_sum)
    it = data_iterator(mbs, attention="mask")
    total, count, want_total, want_count = 0.0, 0, 0.0, 0
    for mb in mbs:
        out, loss_func = fwd(it, None)
        s, n, _ = loss_func(out)
        total, count = total + float(s), count + int(n)
        ws, wn = loss_sums(logits[mb.microbatch], mb["labels"], mb["cu_seqlens"], mode)
        want_total, want_count = want_total + float(ws), want_count + int(wn)
    assert count == want_count
    assert total / count == pytest.approx(want_total / want_count, rel=1e-6)


def test_data_iterator_pads_an_empty_microbatch() -> None:
    """An empty microbatch becomes one padding token without loss: every pipeline stage still
    runs it (Megatron's attention cannot take zero tokens) and it adds nothing."""
    from entrain_data.adapters.megatron import data_iterator, make_forward_step, max_tokens
    from entrain_data.adapters.reference_model import pack_microbatch

    samples = {s.key: s for s in global_batches(1)[0]}
    keys = list(samples)
    mbs = [
        pack_microbatch(samples, keys[:3], keys[:3], microbatch=0),
        pack_microbatch(samples, [], [], microbatch=1),
    ]
    assert mbs[1].num_tokens == 0 and max_tokens(mbs[1:]) == 1
    for attention in ("mask", "thd"):
        item = list(data_iterator(mbs, attention=attention))[1]
        assert item["microbatch"] is mbs[1]
        assert item["tokens"].shape == item["labels"].shape == item["position_ids"].shape == (1, 1)
        assert float(item["loss_mask"].sum()) == 0.0
    fwd = make_forward_step(lambda item, m, buf: item["tokens"].float().sum() * 0)
    it = data_iterator(mbs[1:], attention="mask")
    out, loss_func = fwd(it, None)
    assert int(loss_func(out)[1]) == 0


def _unused_param_step(rank: int, config: object, out: str) -> None:
    """One iteration in which replica 0 alone has audio and the model has no dummy touch, so
    rank 1's audio encoder has no gradient at all when finalize_per_token_grads reduces."""
    from entrain_data.adapters.common import EncoderOutputBuffer
    from entrain_data.adapters.megatron import data_iterator, make_forward_step, max_tokens
    from entrain_data.adapters.reference_model import pack_microbatch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _MegatronWrapped(config)
    model.mllm.dummy_touch = lambda: 0.0
    mine = _split_by_audio()[rank]
    mbs = [
        pack_microbatch({s.key: s for s in mine}, [s.key], [s.key], microbatch=j)
        for j, s in enumerate(mine)
    ]
    get_forward_backward_func()(
        forward_step_func=make_forward_step(
            lambda item, m, buf: m.mllm(item["microbatch"], buf)[0], buffer=EncoderOutputBuffer()
        ),
        data_iterator=data_iterator(mbs),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=max_tokens(mbs),
        micro_batch_size=1,
    )
    grads = {
        k.removeprefix("mllm."): None if p.grad is None else p.grad.clone()
        for k, p in model.named_parameters()
    }
    torch.save(grads, out)


def _split_by_audio() -> list[list]:
    """Two replicas' samples (3 each): the first's all with audio, the second's all without."""
    from entrain_data.adapters.reference_model import synthetic_samples

    pool = synthetic_samples(24, seed=5, prefix="u")
    audio = [s for s in pool if s.audio.shape[0] > 0][:3]
    plain = [s for s in pool if s.audio.shape[0] == 0][:3]
    assert len(audio) == len(plain) == 3
    return [audio, plain]


@pytest.mark.timeout(200)
def test_finalize_reduces_a_gradient_present_on_one_rank_only(mcore_results: str) -> None:
    """Without the zero fill, rank 0 all-reduces the audio encoder's gradients while rank 1
    skips them: mismatched collectives (a gloo error or a hang)."""
    from entrain_data.adapters.reference_model import pack_microbatch

    samples = [s for part in _split_by_audio() for s in part]
    model = make_model()
    model.dummy_touch = lambda: 0.0
    keys = [s.key for s in samples]
    loss_sum, count = model(pack_microbatch({s.key: s for s in samples}, keys, keys))
    (loss_sum / count).backward()
    for rank in range(2):
        got = torch.load(f"{mcore_results}.unused.{rank}")
        for name, p in model.named_parameters():
            assert got[name] is not None, f"rank {rank}: {name} has no gradient"
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6)
