"""FSDP2 with every transformer block wrapped, the way vision-language fine-tuning recipes run it.

What a user adds (torchtitan / accelerate's FSDP2 auto-wrap layout)::

    mesh = device_mesh_from_plan(plan)
    shard_per_block(model, mesh["dp"], blocks=[*vision_blocks, *llm_blocks], bf16=True)
    for mbs in group_iterations(loader):
        accumulate_gradients(model, mbs, dp_group=mesh["dp"].get_group())

Each block then all-gathers its parameters at every call, in forward and in
backward, so every rank must call each block the same number of times:
:func:`~.torch.accumulate_gradients` sees the per-block wrapping and makes the
encoder calls group-wide (:mod:`entrain_data.encoder_calls`). bf16:
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: fp32
master weights and optimizer, bf16 compute, gradients reduced in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import InvalidInput
from ..plan import ParallelPlan

__all__ = [
    "mixed_precision_policy",
    "shard_per_block",
    "reference_blocks",
    "recompute_blocks",
    "wrap_from_plan",
]


def mixed_precision_policy(bf16: bool) -> Any:
    """FSDP2's policy for ``bf16`` (None: fp32 throughout)."""
    if not bf16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def reference_blocks(model: nn.Module) -> list[nn.Module]:
    """The reference model's blocks to wrap: each encoder (one block each) and each LLM layer."""
    return [model.vision, model.audio, *model.layers]


def shard_per_block(
    model: nn.Module,
    mesh: Any,
    blocks: Iterable[nn.Module] | None = None,
    *,
    bf16: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` each of ``blocks`` (default: :func:`reference_blocks`), then the root
    (embedding, norm, head); ``mesh``: the data-parallel mesh (``mesh["dp"]`` of the plan's)."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(reference_blocks(model) if blocks is None else blocks)
    if not blocks:
        raise InvalidInput("shard_per_block: no blocks given; use fully_shard(model) instead")
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    policy = mixed_precision_policy(bf16)
    if policy is not None:
        kw["mp_policy"] = policy
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def recompute_blocks(blocks: Iterable[nn.Module]) -> None:
    """Full activation recomputation of each block, in place: its forward runs under torch's
    non-reentrant ``checkpoint``, so only the block's inputs are kept and the backward repeats
    the forward (inside the block's own FSDP hooks, which gather the weights first)."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        block.forward = functools.partial(_checkpointed, checkpoint, block.forward)  # type: ignore[method-assign]


def _checkpointed(checkpoint: Any, forward: Any, *args: Any, **kw: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kw)


def wrap_from_plan(
    model: nn.Module,
    plan: ParallelPlan,
    mesh: Any,
    blocks: Iterable[nn.Module] | None = None,
    *,
    bf16: bool = False,
) -> nn.Module:
    """Apply the plan's data-parallel sharding and recomputation to a one-stage (pp=1) model.

    ``full``: :func:`shard_per_block` (ZeRO-3); ``gradients``: the same without
    resharding after forward (weights stay gathered until the backward, ZeRO-2's
    memory); ``optimizer`` / ``none``: torch DDP (pair it with
    ``ZeroRedundancyOptimizer`` for ``optimizer``). ``mesh``: the plan's
    ``("pp", "dp", "tp")`` mesh. Blocks recompute when ``plan.stages[0].recompute``.
    """
    if plan.pp != 1:
        raise InvalidInput(
            f"wrap_from_plan: plan.pp={plan.pp}; pipelined plans go through PipelineTrainer"
        )
    blocks = list(reference_blocks(model) if blocks is None else blocks)
    if plan.stages[0].recompute:
        recompute_blocks(blocks)
    if plan.sharding in ("full", "gradients"):
        return shard_per_block(
            model, mesh["dp"], blocks, bf16=bf16, reshard_after_forward=plan.sharding == "full"
        )
    if bf16:
        raise InvalidInput(
            f"wrap_from_plan: bf16 with plan.sharding={plan.sharding!r} (DDP): use "
            "torch.autocast in the forward, or sharding 'gradients'/'full' (FSDP2 mixed precision)"
        )
    return nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
