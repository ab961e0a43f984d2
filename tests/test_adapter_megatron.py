"""Megatron-Core adapter against the real megatron-core 0.16.1 schedules (CPU, gloo, 2 ranks).

Megatron's schedules allocate their token counter on CUDA; the TEST-ONLY
:mod:`_megatron_shim` (shared with the GPTModel pipeline test) points that and
Megatron's other CUDA-only calls at the CPU inside each test rank. Nothing in
the adapter depends on it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(200)
def test_megatron_schedule_balanced_equals_unbalanced(tmp_path: Path) -> None:
    """Megatron-Core's forward_backward_func (dp=2) with per-token loss matches one process."""
    out = tmp_path / "mcore.pt"
    run_ranks(_mcore_rank, str(out), timeout=180)
    assert_params_close(torch.load(out), reference_params(global_batches(STEPS)))


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
