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

Encoder-only pipeline stages (multi-module layout): a plan whose leading stages
hold only encoder layers is applied with Megatron-Core 0.16.1's multi-module
pieces, not with ``initialize_model_parallel``::

    grids = module_grids_from_plan(plan)     # {"vision+audio": HyperCommGrid, "llm": ...}
    comm = multimodule_communicator(plan, config, grids)  # MultiModulePipelineCommunicator
    # encoder ranks: comm.send_forward({enc: x}) / comm.recv_backward()[enc]
    # first LLM stage: comm.recv_forward()[enc] / comm.send_backward({enc: grad})
    config = TransformerConfig(..., **llm_transformer_settings(plan))  # the LLM module alone

One grid per module: the encoder stages' ranks, then the LLM stages' ranks,
each with dims ``tp, cp, dp, pp`` in the order of ``plan.rank_coords`` (TP
fastest, then DP, then pipeline), so a rank's place in its module's grid is its
place in the plan. The topology is ``{encoder: [llm], llm: []}``; activations
crossing the bridge are 3-D ``[s, b, h]`` (the bridge exchanges 3-element
shapes). Megatron-Core 0.16.1 has no schedule that drives the multi-module
communicator: ``forward_backward_pipelining_without_interleaving`` takes a
``P2PCommunicator`` and reads its ``pp_group`` (schedules.py:1985, 2094), which
``MultiModulePipelineCommunicator`` has not; the caller runs the microbatches
(e.g. all forwards, then all backwards, which also lets a deferred sample's
encoder gradient arrive once every consumer has run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..batch import Microbatch
from ..errors import InvalidInput, PlanError
from .common import LOSS_MODES, EncoderOutputBuffer, loss_units, require_world

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
    "GRID_DIMS",
    "BRIDGE_DIM_MAPPING",
    "ModuleLayout",
    "module_layouts",
    "module_topology",
    "module_grids_from_plan",
    "multimodule_communicator",
    "llm_transformer_settings",
]

log = logging.getLogger(__name__)

MEGATRON_CORE_VERSION = "0.16.1"
"""The megatron-core version these helpers were built and tested against."""

ATTENTION_MODES = ("thd", "mask")


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
    A plan with encoder-only stages is refused: its LLM is one module of a
    multi-module layout (:func:`module_grids_from_plan`,
    :func:`llm_transformer_settings`).
    """
    counts = _llm_layers(plan)
    if 0 in counts:
        raise PlanError(
            "megatron adapter: a stage without LLM layers needs Megatron's multi-module "
            f"(encoder) pipeline; stage LLM layer counts {counts}: use module_grids_from_plan, "
            "multimodule_communicator and llm_transformer_settings"
        )
    return _settings_from_counts(plan.tp, counts)


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
    """
    if attention not in ATTENTION_MODES:
        raise InvalidInput(
            f"data_iterator: attention {attention!r}: choose one of {', '.join(ATTENTION_MODES)}"
        )
    for mb in microbatches:
        valid = mb["labels"] != -100
        item = {
            "microbatch": mb,
            "tokens": mb["input_ids"][None],
            "labels": torch.where(valid, mb["labels"], 0)[None],
            "position_ids": mb["position_ids"][None],
            "loss_mask": valid.float()[None],
        }
        if attention == "thd":
            item["packed_seq_params"] = packed_seq_params(mb)
        else:
            item["attention_mask"] = block_causal_mask(mb["cu_seqlens"])
        yield item


def masked_loss_sum(per_token_loss: torch.Tensor, item: dict[str, Any]) -> torch.Tensor:
    """``loss_sum`` for :func:`make_forward_step` when the model returns per-token losses
    (``GPTModel`` given ``labels``): the sum over the item's loss tokens."""
    return (per_token_loss.float() * item["loss_mask"]).sum()


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
    by the global loss count (summed over pipeline and DP)."""
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
    for chunk in model:
        for p in chunk.parameters():
            if p.grad is None:
                continue
            if dist.get_world_size(dpg) > 1:
                dist.all_reduce(p.grad, group=dpg)
            p.grad.div_(float(total))


# ------------------------------------------------------------ multi-module (encoder stages)
GRID_DIMS = ("tp", "cp", "dp", "pp")
"""``HyperCommGrid`` dim names, fastest first: the order of ``plan.rank_coords`` (cp is 1)."""

BRIDGE_DIM_MAPPING = {"s": 0, "b": 1, "h": 2}
"""Axes of activations crossing the encoder -> LLM bridge: Megatron's ``[s, b, h]``."""


@dataclass(frozen=True)
class ModuleLayout:
    """One module of a multi-module plan: its pipeline stages and the ranks that run them.

    The plan's rank order puts the pipeline stage slowest, so a module made of
    consecutive stages owns one contiguous block of ranks starting at
    ``rank_offset``; inside it, ranks follow ``plan.rank_coords``.
    """

    name: str
    stages: tuple[int, ...]
    rank_offset: int
    tp: int
    dp: int

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def ranks(self) -> list[int]:
        return list(range(self.rank_offset, self.rank_offset + self.size))

    @property
    def grid_shape(self) -> list[int]:
        """``HyperCommGrid`` shape for :data:`GRID_DIMS`."""
        return [self.tp, 1, self.dp, self.pp]


def _is_encoder_only(stage: Any) -> bool:
    return all(s.encoder_index is not None for s in stage.segments)


def module_layouts(
    plan: Any, *, encoder_name: str | None = None, llm_name: str = "llm"
) -> dict[str, ModuleLayout]:
    """The encoder module (the plan's leading encoder-only stages) and the LLM module (the rest).

    Validation names the plan field at fault: encoder-only stages must come
    first, at least one of each kind must exist, and encoder layers may ride
    only on the first LLM stage (where the encoder outputs arrive).
    ``encoder_name`` defaults to the encoder modules of those stages, ``+``-joined.
    """
    stages = list(plan.stages)
    n_enc = 0
    while n_enc < len(stages) and _is_encoder_only(stages[n_enc]):
        n_enc += 1
    if n_enc == 0:
        raise PlanError(
            "megatron multi-module: plan.stages[0] holds LLM layers: no encoder-only stage, so "
            "there is one module; use initialize_from_plan and transformer_settings"
        )
    if n_enc == len(stages):
        raise PlanError(
            f"megatron multi-module: plan.stages: all {n_enc} stages are encoder-only, "
            "no stage holds LLM layers"
        )
    for i, stage in enumerate(stages[n_enc:], start=n_enc):
        if _is_encoder_only(stage):
            raise PlanError(
                f"megatron multi-module: plan.stages[{i}] is encoder-only but follows LLM stage "
                f"{n_enc}; encoder stages must precede every LLM stage"
            )
        riding = [s.module for s in stage.segments if s.encoder_index is not None]
        if riding and i > n_enc:
            raise PlanError(
                f"megatron multi-module: plan.stages[{i}].segments hold encoder layers "
                f"{riding} on LLM stage {i}; only the first LLM stage ({n_enc}) may"
            )
    enc_modules = dict.fromkeys(s.module for st in stages[:n_enc] for s in st.segments)
    enc = encoder_name or "+".join(enc_modules)
    if enc == llm_name:
        raise InvalidInput(f"megatron multi-module: encoder_name and llm_name are both {enc!r}")
    per_stage = plan.tp * plan.dp
    return {
        enc: ModuleLayout(enc, tuple(range(n_enc)), 0, plan.tp, plan.dp),
        llm_name: ModuleLayout(
            llm_name, tuple(range(n_enc, len(stages))), n_enc * per_stage, plan.tp, plan.dp
        ),
    }


def module_topology(layouts: Mapping[str, ModuleLayout]) -> dict[str, list[str]]:
    """``MultiModulePipelineCommunicator`` topology: the encoder module feeds the LLM module."""
    enc, llm = list(layouts)
    return {enc: [llm], llm: []}


def module_grids_from_plan(
    plan: Any,
    *,
    encoder_name: str | None = None,
    llm_name: str = "llm",
    backend: str | None = None,
    create_groups: bool = True,
) -> dict[str, Any]:
    """One Megatron-Core ``HyperCommGrid`` per module (see :func:`module_layouts`).

    With ``create_groups`` (a collective: every rank calls it, in the same
    order) each grid gets its ``tp``, ``cp``, ``dp``, ``pp`` and ``dp-cp``
    process groups, whose members are the ranks that share those coordinates
    in ``plan.rank_coords``. ``backend`` None: the default process group's.
    Without groups the grids only describe the layout (``get_rank_enum``); like
    ``HyperCommGrid`` itself they need ``WORLD_SIZE`` or an initialised process group.
    """
    from megatron.core.hyper_comm_grid import HyperCommGrid

    layouts = module_layouts(plan, encoder_name=encoder_name, llm_name=llm_name)
    if create_groups:
        require_world(plan, "module_grids_from_plan")
    grids = {}
    for name, lay in layouts.items():
        grid = HyperCommGrid(
            lay.grid_shape, list(GRID_DIMS), rank_offset=lay.rank_offset, backend=backend
        )
        if create_groups:
            for dims in ("tp", "cp", "dp", "pp", ["dp", "cp"]):
                grid.create_pg(dims)
        grids[name] = grid
    return grids


def multimodule_communicator(
    plan: Any,
    config: Any,
    grids: Mapping[str, Any] | None = None,
    *,
    encoder_name: str | None = None,
    llm_name: str = "llm",
) -> Any:
    """Megatron-Core's ``MultiModulePipelineCommunicator`` joining the encoder module's last
    stage to the LLM's first (a collective: it builds the bridge's groups on every rank).

    ``config`` (a ``ModelParallelConfig``/``TransformerConfig``) must set
    ``pipeline_dtype`` (the bridge receives in it) and ``variable_seq_lengths``
    (balanced microbatches differ in length inside each module).
    """
    from megatron.core.pipeline_parallel.multimodule_communicator import (
        MultiModulePipelineCommunicator,
    )

    if getattr(config, "pipeline_dtype", None) is None:
        raise InvalidInput(
            "multimodule_communicator: config.pipeline_dtype is None; the bridge allocates "
            "received activations and gradients in it"
        )
    if not getattr(config, "variable_seq_lengths", False):
        raise InvalidInput(
            "multimodule_communicator: config.variable_seq_lengths is False; balanced "
            "microbatches differ in length"
        )
    layouts = module_layouts(plan, encoder_name=encoder_name, llm_name=llm_name)
    if grids is None:
        grids = module_grids_from_plan(plan, encoder_name=encoder_name, llm_name=llm_name)
    if list(grids) != list(layouts):
        raise InvalidInput(
            f"multimodule_communicator: grids name modules {list(grids)}, "
            f"the plan's are {list(layouts)}"
        )
    for name, lay in layouts.items():
        grid = grids[name]
        got = (list(grid.shape), list(grid.dim_names), grid.rank_offset)
        if got != (lay.grid_shape, list(GRID_DIMS), lay.rank_offset):
            raise InvalidInput(
                f"multimodule_communicator: grids[{name!r}] (shape, dims, rank_offset) = {got}, "
                f"the plan's is {(lay.grid_shape, list(GRID_DIMS), lay.rank_offset)}"
            )
    return MultiModulePipelineCommunicator(
        dict(grids), module_topology(layouts), config, dim_mapping=dict(BRIDGE_DIM_MAPPING)
    )


def llm_transformer_settings(plan: Any, *, llm_name: str = "llm") -> dict[str, Any]:
    """:func:`transformer_settings` for the LLM module of a multi-module plan: its own pipeline
    (the LLM stages only) and layer split. The encoders keep their own configs."""
    lay = module_layouts(plan, llm_name=llm_name)[llm_name]
    return _settings_from_counts(plan.tp, [_llm_layers(plan)[i] for i in lay.stages])
