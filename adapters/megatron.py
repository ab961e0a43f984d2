"""Megatron-Core: settings from the plan, packed-sequence data iterator, per-token loss
(built against megatron-core 0.16.1).

What a user adds to a Megatron-Core script (see ``examples/train_megatron.py``)::

    initialize_from_plan(plan)                         # TP/PP groups, microbatch calculator
    config = TransformerConfig(..., **transformer_settings(plan))
    config.finalize_model_grads_func = finalize_per_token_grads   # plain (non-Megatron-DDP) models
    fwd_bwd = get_forward_backward_func()
    for mbs in group_iterations(loader):
        fwd_bwd(forward_step_func=make_forward_step(step_fn, loss_sum=masked_loss_sum),
                data_iterator=data_iterator(mbs, attention="mask"),
                model=[model], num_microbatches=len(mbs), seq_length=max_tokens(mbs),
                micro_batch_size=1)
        optimizer.step()

Attention over a packed microbatch: ``attention="thd"`` hands the model
``PackedSeqParams`` (THD), which only Transformer Engine's attention accepts
(Megatron-Core's local ``DotProductAttention`` asserts ``packed_seq_params is
None``). ``attention="mask"`` hands it a block-diagonal causal
``attention_mask`` instead (one causal block per sample, ``True`` = masked, the
local spec's convention), with ``position_ids`` restarting at every sample:
the same attention as one sequence per sample, at O(T^2) memory per
microbatch, for the local spec, CPU runs and tests. Positions reach the model
only through ``position_ids``, so use ``learned_absolute`` position embeddings
with ``"mask"``: Megatron's RoPE indexes the packed row 0..T-1 unless it is
given THD ``packed_seq_params``.

Loss: with ``calculate_per_token_loss=True`` Megatron neither divides a
microbatch's loss by its tokens nor by ``num_microbatches``; the loss function
returns ``(loss_sum, num_tokens, {...})``, the schedule sums ``num_tokens``
and hands it to ``finalize_model_grads_func``. Megatron's own
``finalize_model_grads`` then scales its DDP's gradients by the global count;
:func:`finalize_per_token_grads` does the same for a model without Megatron's
DDP wrapper (sum over DP, divide by the token count summed over the pipeline
and DP). ``variable_seq_lengths=True`` makes the pipeline schedules exchange
shapes for every microbatch, which balanced microbatches need. With tied
input/output embeddings and pipelining, the two copies of the embedding (first
and last stage) get their gradients summed over Megatron's embedding group,
as Megatron's own ``finalize_model_grads`` does.

Encoder-only pipeline stages (multi-module layout): see :mod:`.megatron_multimodule`.
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
from ..plan import ParallelPlan
from .common import (
    LOSS_MODES,
    EncoderOutputBuffer,
    collective_device,
    iteration_microbatches,
    loss_units,
    require_world,
    resolve_encoder_calls,
)

__all__ = [
    "MEGATRON_CORE_VERSION",
    "transformer_settings",
    "initialize_from_plan",
    "packed_seq_params",
    "block_causal_mask",
    "data_iterator",
    "masked_loss_sum",
    "make_forward_step",
    "finalize_per_token_grads",
    "max_tokens",
    "prepare_iteration",
    "ddp_settings",
    "optimizer_settings",
]

log = logging.getLogger(__name__)

MEGATRON_CORE_VERSION = "0.16.1"
"""The megatron-core version these helpers were built and tested against."""

ATTENTION_MODES = ("thd", "mask")


def transformer_settings(plan: ParallelPlan, stage: int | None = None) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments from the plan: parallel sizes, the uneven layer
    split (first/last stage layer counts), per-token loss and variable sequence lengths.

    Megatron-Core 0.16.1 splits the middle stages evenly; a plan whose middle
    stages differ is refused (name the stage) rather than silently re-split.
    A plan with encoder-only stages is refused: its LLM is one module of a
    multi-module layout (:func:`module_grids_from_plan`,
    :func:`llm_transformer_settings`).

    Recomputation: full, uniform, one layer per checkpoint when this rank's
    pipeline ``stage`` recomputes in the plan (``stage`` None: when every stage does).
    """
    ranges = plan.llm_layer_ranges(
        "megatron adapter",
        hint="a stage without LLM layers needs Megatron's multi-module (encoder) pipeline: "
        "use module_grids_from_plan, multimodule_communicator and llm_transformer_settings",
    )
    settings = _settings_from_counts(plan.tp, [end - start for start, end in ranges])
    flags = [st.recompute for st in plan.stages]
    if flags[stage] if stage is not None else all(flags):
        settings.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return settings


def _settings_from_counts(tp: int, counts: list[int]) -> dict[str, Any]:
    """Settings for a pipeline of ``len(counts)`` stages holding ``counts`` LLM layers each."""
    pp = len(counts)
    settings: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "num_layers": sum(counts),
        "variable_seq_lengths": True,
        # 0.16.1 refuses variable_seq_lengths with its default "allgather" MoE dispatcher,
        # even for dense models
        "moe_token_dispatcher_type": "alltoall",
        "calculate_per_token_loss": True,
    }
    if pp > 2 and len(set(counts[1:-1])) > 1:
        raise PlanError(f"megatron adapter: middle stages hold unequal layer counts {counts}")
    if pp > 1 and len(set(counts)) > 1:
        settings["num_layers_in_first_pipeline_stage"] = counts[0]
        settings["num_layers_in_last_pipeline_stage"] = counts[-1]
    return settings


def initialize_from_plan(plan: ParallelPlan, micro_batch_size: int = 1) -> None:
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

    require_world(plan, "initialize_from_plan")
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
    return _thd_params(mb["cu_seqlens"])


def _thd_params(cu_seqlens: torch.Tensor) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    longest = int(torch.diff(cu).max()) if cu.numel() > 1 else 0
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def max_tokens(microbatches: Sequence[Microbatch]) -> int:
    """The longest packed microbatch (``seq_length`` for the schedule's buffers); at least 1,
    the padding token :func:`data_iterator` gives an empty microbatch."""
    microbatches = iteration_microbatches(microbatches, "max_tokens")
    return max(1, max(mb.num_tokens for mb in microbatches))


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[1, 1, T, T]`` boolean mask, ``True`` where attention is *not* allowed (Megatron's
    convention): each token sees only earlier tokens of its own sample, so a packed row attends
    like one sequence per sample without ``PackedSeqParams``."""
    lengths = torch.diff(cu_seqlens.long())
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    allowed = (owner[:, None] == owner[None, :]).tril()
    return (~allowed)[None, None]


def data_iterator(
    microbatches: Sequence[Microbatch], attention: str = "thd"
) -> Iterator[dict[str, Any]]:
    """One item per microbatch: the ``Microbatch`` and its batch-first ``[1, T]`` tensors.

    ``labels`` hold 0 where ``loss_mask`` is 0 (Megatron's cross entropy has no
    ignore index; the mask carries it). ``attention="thd"`` adds
    ``packed_seq_params`` (Transformer Engine attention); ``"mask"`` adds
    ``attention_mask`` from :func:`block_causal_mask` (local spec, CPU). Every
    pipeline stage of a replica iterates the same microbatches.

    An empty microbatch (no LLM tokens: the assignment may leave one without
    samples) becomes one padding token with no loss (``loss_mask`` 0): Megatron's
    schedules run every microbatch on every stage of a pipeline, which must agree
    on the count, and its attention cannot run on zero tokens. The padding adds
    nothing to the loss, its count or any gradient; ``item["microbatch"]`` stays
    the real, empty one (encoder work deferred from it still runs).
    """
    if attention not in ATTENTION_MODES:
        raise InvalidInput(
            f"data_iterator: attention {attention!r}: choose one of {', '.join(ATTENTION_MODES)}"
        )
    # checked here, not when the schedule first pulls an item deep inside Megatron
    return _items(
        iteration_microbatches(microbatches, "data_iterator", ("position_ids",)), attention
    )


def _items(microbatches: list[Microbatch], attention: str) -> Iterator[dict[str, Any]]:
    for mb in microbatches:
        if mb.num_tokens == 0:
            device = mb["input_ids"].device if "input_ids" in mb else None
            pad = torch.zeros(1, dtype=torch.int64, device=device)
            ids, labels, positions = pad, pad - 100, pad
            cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
        else:
            ids, labels, positions = mb["input_ids"], mb["labels"], mb["position_ids"]
            cu = mb["cu_seqlens"]
        valid = labels != -100
        item = {
            "microbatch": mb,
            "tokens": ids[None],
            "labels": torch.where(valid, labels, 0)[None],
            "position_ids": positions[None],
            "loss_mask": valid.float()[None],
            "cu_seqlens": cu,
        }
        if attention == "thd":
            item["packed_seq_params"] = _thd_params(cu)
        else:
            item["attention_mask"] = block_causal_mask(cu)
        yield item


def masked_loss_sum(per_token_loss: torch.Tensor, item: dict[str, Any]) -> torch.Tensor:
    """``loss_sum`` for :func:`make_forward_step` when the model returns per-token losses
    (``GPTModel`` given ``labels``), matching the count :func:`make_forward_step` reports for
    its ``mode`` (``item["loss_mode"]``): the sum over the item's loss tokens (``token``),
    or the sum over its samples of each one's mean token loss (``sample``)."""
    mask = item["loss_mask"].reshape(-1)
    loss = per_token_loss.float().reshape(-1) * mask
    mode = item.get("loss_mode", "token")
    if mode == "token":
        return loss.sum()
    if mode not in LOSS_MODES:
        raise InvalidInput(f"loss mode {mode!r}: choose one of {', '.join(LOSS_MODES)}")
    lengths = torch.diff(item["cu_seqlens"].long()).to(loss.device)
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=loss.device), lengths)
    per_sum = loss.new_zeros(len(lengths)).index_add(0, owner, loss)
    per_n = loss.new_zeros(len(lengths)).index_add(0, owner, mask.to(loss.dtype))
    has = per_n > 0
    return (per_sum[has] / per_n[has]).sum()


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
    denominator, so ``loss_sum`` must sum what ``count`` counts: the item carries
    ``item["loss_mode"] = mode`` (:func:`masked_loss_sum` reads it). ``buffer`` carries
    deferred samples' encoder outputs.
    """
    if mode not in LOSS_MODES:
        raise InvalidInput(f"loss mode {mode!r}: choose one of {', '.join(LOSS_MODES)}")
    buffer = buffer if buffer is not None else EncoderOutputBuffer()

    def forward_step(it: Iterator[dict[str, Any]], model: nn.Module) -> tuple[Any, Callable]:
        item = next(it)
        item["loss_mode"] = mode
        output = step(item, model, buffer)
        count = loss_units(item["microbatch"], mode)

        def loss_func(out: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            total = out if loss_sum is None else loss_sum(out, item)
            n = torch.tensor(count, dtype=torch.int)
            return total, n, {"loss_sum": total.detach().clone(), "count": n}

        return output, loss_func

    return forward_step


def _tied_embedding_weight(chunk: nn.Module) -> nn.Parameter | None:
    """The word-embedding copy this stage holds when input and output embeddings are tied."""
    from megatron.core.utils import get_attr_wrapped_model

    inner = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
    if not getattr(inner, "share_embeddings_and_output_weights", False):
        return None
    return inner.shared_embedding_or_output_weight()


def _allreduce_tied_embedding_grads(model: Sequence[nn.Module]) -> None:
    """Sum the tied embedding's gradient over its copies on the first and last stages, so both
    copies take the same step (Megatron's ``finalize_model_grads`` does this for its DDP)."""
    from megatron.core import parallel_state

    group = parallel_state.get_embedding_group(check_initialized=False)
    if group is None or dist.get_world_size(group) <= 1:
        return
    if dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    weight = _tied_embedding_weight(model[0] if first else model[-1])
    if weight is None or weight.grad is None:
        return  # untied, or frozen embeddings (then on every stage of the group)
    dist.all_reduce(weight.grad, group=group)


def finalize_per_token_grads(
    model: Sequence[nn.Module], num_tokens: torch.Tensor | None, pg_collection: Any = None, **_: Any
) -> None:
    """``finalize_model_grads_func`` for models without Megatron's DDP: sum tied embedding
    gradients over the first and last stages, sum gradients over data-parallel ranks and divide
    by the global loss count (summed over pipeline and DP).

    A trainable parameter with a gradient on some DP ranks only (an encoder no microbatch
    of one replica used) gets a zero gradient on the others before the per-parameter
    reduction, so every rank issues the same collectives; one with no gradient on any
    rank keeps ``None`` (the optimizer skips it, as without data parallelism)."""
    from megatron.core import parallel_state

    if num_tokens is None:
        raise InvalidInput("finalize_per_token_grads needs calculate_per_token_loss=True")
    # stays on the counter's device: NCCL reduces only CUDA tensors
    total = num_tokens.detach().to(torch.int64).clone()
    pp = parallel_state.get_pipeline_model_parallel_group()
    dpg = parallel_state.get_data_parallel_group()
    if dist.get_world_size(pp) > 1:
        dist.all_reduce(total, group=pp)  # only the last stage counted tokens
        _allreduce_tied_embedding_grads(model)
    if dist.get_world_size(dpg) > 1:
        dist.all_reduce(total, group=dpg)
    if int(total) <= 0:
        raise InvalidInput("finalize_per_token_grads: the global batch has no loss tokens")
    params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
    if dist.get_world_size(dpg) > 1:
        has = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.int32, device=collective_device(dpg)
        )
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=dpg)  # one small reduction
        for p, anywhere in zip(params, has.tolist()):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dpg)
    for p in params:
        if p.grad is not None:
            p.grad.div_(float(total))


# ------------------------------------------------ Megatron-Core DDP + distributed optimizer
def ddp_settings(plan: ParallelPlan | None = None, *, bf16: bool = False) -> dict[str, Any]:
    """``DistributedDataParallelConfig`` keyword arguments for balanced microbatches.

    ``use_distributed_optimizer`` unless ``plan.sharding`` is ``"none"``;
    ``"full"`` is refused: Megatron-Core's DDP keeps whole weights on every rank.

    ``overlap_grad_reduce``: buckets reduce during the last microbatch's backward,
    as Megatron users run it; safe here because :func:`prepare_iteration` makes
    every rank run every encoder in every microbatch (group-wide calls), so each
    bucket's parameters all get their gradient in the last microbatch on every
    rank. ``grad_reduce_in_fp32`` with bf16: the microbatches' bf16 gradients
    accumulate in fp32 ``main_grad`` (a balanced step sums M of them).
    """
    return {
        "use_distributed_optimizer": _distributed_optimizer(plan),
        "overlap_grad_reduce": True,
        "grad_reduce_in_fp32": bf16,
        "average_in_collective": False,  # per-token loss: finalize_model_grads divides
    }


def optimizer_settings(plan: ParallelPlan | None = None, *, bf16: bool = False) -> dict[str, Any]:
    """``OptimizerConfig`` keyword arguments matching :func:`ddp_settings` (Megatron-Core
    0.16.1's distributed optimizer takes Adam only)."""
    return {"bf16": bf16, "use_distributed_optimizer": _distributed_optimizer(plan)}


def _distributed_optimizer(plan: ParallelPlan | None) -> bool:
    if plan is None:
        return True
    if plan.sharding == "full":
        raise InvalidInput(
            "megatron adapter: plan.sharding='full' shards the weights, which Megatron-Core's "
            "DistributedDataParallel does not; use Megatron-FSDP, or plan.sharding='optimizer' "
            "(distributed optimizer), or the torch adapter's shard_per_block (FSDP2)"
        )
    return plan.sharding != "none"


def prepare_iteration(
    microbatches: Sequence[Microbatch],
    buffer: EncoderOutputBuffer,
    *,
    uniform_encoder_calls: bool = True,
    group: Any = None,
) -> list[Microbatch]:
    """This rank's microbatches of one iteration, ready for :func:`data_iterator`: ``buffer``
    learns each deferred sample's consumer and, with ``uniform_encoder_calls``, every
    microbatch carries the group-wide encoder calls (:mod:`entrain_data.encoder_calls`;
    ``group``: the data-parallel group, default Megatron's). Every DP rank calls it, in step."""
    microbatches = iteration_microbatches(microbatches, "prepare_iteration")
    buffer.expect(microbatches)
    if not uniform_encoder_calls:
        return list(microbatches)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
    return resolve_encoder_calls(microbatches, group=group)
