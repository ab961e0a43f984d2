"""Megatron-Core: settings from the plan, packed-sequence data iterator, per-token loss
(built against megatron-core 0.16.1).

What a user adds to a Megatron-Core script::

    initialize_from_plan(plan)                         # TP/PP groups, microbatch calculator
    config = TransformerConfig(..., **transformer_settings(plan))
    config.finalize_model_grads_func = finalize_per_token_grads   # plain (non-Megatron-DDP) models
    fwd_bwd = get_forward_backward_func()
    for mbs in group_iterations(loader):
        fwd_bwd(forward_step_func=make_forward_step(step_fn), data_iterator=data_iterator(mbs),
                model=[model], num_microbatches=len(mbs), seq_length=max_tokens(mbs),
                micro_batch_size=1)
        optimizer.step()

Loss: with ``calculate_per_token_loss=True`` Megatron neither divides a
microbatch's loss by its tokens nor by ``num_microbatches``; the loss function
returns ``(loss_sum, num_tokens, {...})``, the schedule sums ``num_tokens``
and hands it to ``finalize_model_grads_func``. Megatron's own
``finalize_model_grads`` then scales its DDP's gradients by the global count;
:func:`finalize_per_token_grads` does the same for a model without Megatron's
DDP wrapper (sum over DP, divide by the token count summed over the pipeline
and DP). ``variable_seq_lengths=True`` makes the pipeline schedules exchange
shapes for every microbatch, which balanced microbatches need.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..batch import Microbatch
from ..errors import InvalidInput, PlanError
from .common import LOSS_MODES, EncoderOutputBuffer, loss_units

__all__ = [
    "MEGATRON_CORE_VERSION",
    "transformer_settings",
    "initialize_from_plan",
    "packed_seq_params",
    "data_iterator",
    "make_forward_step",
    "finalize_per_token_grads",
    "max_tokens",
]

log = logging.getLogger(__name__)

MEGATRON_CORE_VERSION = "0.16.1"
"""The megatron-core version these helpers were built and tested against."""


def _llm_layers(plan: Any) -> list[int]:
    counts = []
    for stage in plan.stages:
        llm = [s for s in stage.segments if s.encoder_index is None]
        counts.append(sum(s.layer_end - s.layer_start for s in llm))
    return counts


def transformer_settings(plan: Any) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments from the plan: parallel sizes, the uneven layer
    split (first/last stage layer counts), per-token loss and variable sequence lengths.

    Megatron-Core 0.16.1 splits the middle stages evenly; a plan whose middle
    stages differ is refused (name the stage) rather than silently re-split.
    """
    counts = _llm_layers(plan)
    if 0 in counts:
        raise PlanError(
            "megatron adapter: a stage without LLM layers needs Megatron's multi-module "
            f"(encoder) pipeline; stage LLM layer counts {counts}"
        )
    settings: dict[str, Any] = {
        "tensor_model_parallel_size": plan.tp,
        "pipeline_model_parallel_size": plan.pp,
        "num_layers": sum(counts),
        "variable_seq_lengths": True,
        # 0.16.1 refuses variable_seq_lengths with its default "allgather" MoE dispatcher,
        # even for dense models
        "moe_token_dispatcher_type": "alltoall",
        "calculate_per_token_loss": True,
    }
    if plan.pp > 2 and len(set(counts[1:-1])) > 1:
        raise PlanError(f"megatron adapter: middle stages hold unequal layer counts {counts}")
    if plan.pp > 1 and len(set(counts)) > 1:
        settings["num_layers_in_first_pipeline_stage"] = counts[0]
        settings["num_layers_in_last_pipeline_stage"] = counts[-1]
    return settings


def initialize_from_plan(plan: Any, micro_batch_size: int = 1) -> None:
    """Megatron's model-parallel groups and microbatch calculator for this plan.

    The calculator's global batch is ``dp * microbatches`` "microbatches of
    one packed sequence", so ``get_num_microbatches()`` equals the plan's
    microbatches per replica.
    """
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    if not dist.is_initialized():
        raise InvalidInput("initialize_from_plan: torch.distributed is not initialised")
    if dist.get_world_size() != plan.world_size:
        raise InvalidInput(
            f"initialize_from_plan: plan.world_size={plan.world_size}, running {dist.get_world_size()}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp
    )
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(
        dist.get_rank(),
        None,
        plan.dp * plan.microbatches * micro_batch_size,
        micro_batch_size,
        plan.dp,
    )


def packed_seq_params(mb: Microbatch) -> Any:
    """``PackedSeqParams`` (THD format) of the microbatch's packed LLM set."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb["cu_seqlens"].to(torch.int32)
    longest = int(torch.diff(cu).max()) if cu.numel() > 1 else 0
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def max_tokens(microbatches: Sequence[Microbatch]) -> int:
    """The longest packed microbatch (``seq_length`` for the schedule's buffers)."""
    return max(mb.num_tokens for mb in microbatches)


def data_iterator(microbatches: Sequence[Microbatch]) -> Iterator[dict[str, Any]]:
    """One item per microbatch: the ``Microbatch``, its batch-first tensors and PackedSeqParams."""
    for mb in microbatches:
        yield {
            "microbatch": mb,
            "tokens": mb["input_ids"][None],
            "labels": mb["labels"][None],
            "position_ids": mb["position_ids"][None],
            "loss_mask": (mb["labels"] != -100)[None],
            "packed_seq_params": packed_seq_params(mb),
        }


def make_forward_step(
    step: Callable[[dict[str, Any], nn.Module, EncoderOutputBuffer], Any],
    *,
    mode: str = "token",
    buffer: EncoderOutputBuffer | None = None,
    loss_sum: Callable[[Any, dict[str, Any]], torch.Tensor] | None = None,
) -> Callable[[Iterator[dict[str, Any]], nn.Module], tuple[Any, Callable]]:
    """A Megatron ``forward_step_func`` whose loss function returns ``(loss_sum, count, {...})``.

    ``step(item, model, buffer)`` runs the model on one item of
    :func:`data_iterator` and returns its output (on the last stage, what
    ``loss_sum(output, item)`` turns into the microbatch's loss sum; default:
    the output *is* the loss sum). ``count`` is the microbatch's loss tokens
    (or samples, ``mode="sample"``), which Megatron accumulates into the global
    denominator. ``buffer`` carries deferred samples' encoder outputs.
    """
    if mode not in LOSS_MODES:
        raise InvalidInput(f"loss mode {mode!r}: choose one of {', '.join(LOSS_MODES)}")
    buffer = buffer if buffer is not None else EncoderOutputBuffer()

    def forward_step(it: Iterator[dict[str, Any]], model: nn.Module) -> tuple[Any, Callable]:
        item = next(it)
        output = step(item, model, buffer)
        count = loss_units(item["microbatch"], mode)

        def loss_func(out: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            total = out if loss_sum is None else loss_sum(out, item)
            n = torch.tensor(count, dtype=torch.int)
            return total, n, {"loss_sum": total.detach().clone(), "count": n}

        return output, loss_func

    return forward_step


def finalize_per_token_grads(
    model: Sequence[nn.Module], num_tokens: torch.Tensor | None, pg_collection: Any = None, **_: Any
) -> None:
    """``finalize_model_grads_func`` for models without Megatron's DDP: sum gradients over
    data-parallel ranks and divide by the global loss count (summed over pipeline and DP)."""
    from megatron.core import parallel_state

    if num_tokens is None:
        raise InvalidInput("finalize_per_token_grads needs calculate_per_token_loss=True")
    total = num_tokens.detach().to(torch.int64).cpu().clone()
    pp = parallel_state.get_pipeline_model_parallel_group()
    dpg = parallel_state.get_data_parallel_group()
    if dist.get_world_size(pp) > 1:
        dist.all_reduce(total, group=pp)  # only the last stage counted tokens
    if dist.get_world_size(dpg) > 1:
        dist.all_reduce(total, group=dpg)
    if int(total) <= 0:
        raise InvalidInput("finalize_per_token_grads: the global batch has no loss tokens")
    for chunk in model:
        for p in chunk.parameters():
            if p.grad is None:
                continue
            if dist.get_world_size(dpg) > 1:
                dist.all_reduce(p.grad, group=dpg)
            p.grad.div_(float(total))
