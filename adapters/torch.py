"""Plain PyTorch: DeviceMesh from the plan and gradient accumulation over balanced microbatches.

What a user adds to a DDP or FSDP2 script::

    mesh = device_mesh_from_plan(plan)                    # ("pp", "dp", "tp")
    model = DDP(model)                                    # or fully_shard(model, mesh=mesh["dp"])
    for mbs in group_iterations(loader):                  # this rank's microbatches of one iteration
        accumulate_gradients(model, mbs, dp_group=mesh["dp"].get_group())
        optimizer.step(); optimizer.zero_grad()

:func:`accumulate_gradients` scales each microbatch's loss sum so the summed,
DP-averaged gradient is exactly the gradient of the global batch's per-token
(or per-sample) mean loss, whatever the microbatch sizes, keeps gradient
synchronisation off for all but the last microbatch (``no_sync`` for DDP,
``set_requires_gradient_sync`` for FSDP2) and carries deferred samples' encoder
outputs between microbatches in an :class:`~.common.EncoderOutputBuffer`.
torch.distributed.pipelining (1F1B with per-step padding) is not built yet.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..batch import Microbatch
from ..errors import InvalidInput
from .common import EncoderOutputBuffer, global_loss_count, loss_scale

__all__ = ["device_mesh_from_plan", "StepResult", "accumulate_gradients", "ForwardFn"]

log = logging.getLogger(__name__)

ForwardFn = Callable[
    [nn.Module, Microbatch, EncoderOutputBuffer], tuple[torch.Tensor, torch.Tensor]
]
"""``forward(model, mb, buffer) -> (loss_sum, loss_count)`` summed as ``mode`` says;
default ``model(mb, buffer, mode=mode)`` (the reference model's signature)."""


def device_mesh_from_plan(plan: Any, device_type: str = "cpu") -> Any:
    """A 3-D ``DeviceMesh`` named ``("pp", "dp", "tp")`` laid out as the plan's ``rank_coords``
    (tensor-parallel fastest, then data-parallel, then pipeline: Megatron's order)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise InvalidInput("device_mesh_from_plan: torch.distributed is not initialised")
    if dist.get_world_size() != plan.world_size:
        raise InvalidInput(
            f"device_mesh_from_plan: plan.world_size={plan.world_size} but "
            f"{dist.get_world_size()} ranks are running"
        )
    return init_device_mesh(
        device_type, (plan.pp, plan.dp, plan.tp), mesh_dim_names=("pp", "dp", "tp")
    )


@dataclass(frozen=True)
class StepResult:
    """One iteration's outcome on this rank: the global-batch mean loss and its denominator."""

    loss: float
    loss_count: int
    microbatches: int
    tokens: int


def _sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """DDP: ``no_sync`` unless ``sync``; FSDP2: toggle gradient reduction; else nothing."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # torch.distributed.fsdp.FSDPModule
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def accumulate_gradients(
    model: nn.Module,
    microbatches: Sequence[Microbatch],
    forward: ForwardFn | None = None,
    *,
    mode: str = "token",
    dp_group: dist.ProcessGroup | None = None,
    buffer: EncoderOutputBuffer | None = None,
    device: torch.device | str = "cpu",
) -> StepResult:
    """Forward and backward every microbatch of one iteration; gradients end DP-synchronised.

    ``microbatches``: this rank's microbatches of one iteration, in order
    (deferred samples are encoded before they are consumed). ``dp_group``: the
    data-parallel group the wrapper averages over (None: the default group).
    The optimizer step is the caller's.
    """
    if not microbatches:
        raise InvalidInput("accumulate_gradients: no microbatches given for this iteration")
    if forward is None:

        def forward(model: nn.Module, mb: Microbatch, buffer: EncoderOutputBuffer) -> Any:
            return model(mb, buffer, mode=mode)

    buffer = buffer if buffer is not None else EncoderOutputBuffer()
    on = dist.is_available() and dist.is_initialized()
    dp = dist.get_world_size(dp_group) if on else 1
    count = global_loss_count(microbatches, mode, dp_group, device)
    scale = loss_scale(count, dp=dp)
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for j, mb in enumerate(microbatches):
        last = j == len(microbatches) - 1
        with _sync_context(model, last):
            loss_sum, _ = forward(model, mb.to(device), buffer)
            (loss_sum * scale).backward()
        total += loss_sum.detach().double()
        tokens += mb.num_tokens
    buffer.check_drained(microbatches[0].iteration)
    if on and dp > 1:
        dist.all_reduce(total, group=dp_group)
    return StepResult(float(total) / count, count, len(microbatches), tokens)
