"""DeepSpeed: config from the plan, balanced microbatches fed to its engines (built against 0.19.8).

What a user adds to a DeepSpeed script::

    config = deepspeed_config(plan, user_config)          # micro batch, accumulation, dp
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    for mbs in group_iterations(loader):
        train_step(engine, mbs)                           # plain engine, ZeRO 0-3

    # or, pipeline-parallel:
    feeder = PipelineFeeder(model)                        # reference-model pipe layers
    net = PlannedPipelineModule(feeder.layers(), plan=plan, loss_fn=feeder.loss_fn,
                                dynamic_shape=True)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    for mbs in group_iterations(loader):
        feeder.train_batch(engine, mbs)

Loss: DeepSpeed divides each microbatch's loss by ``gradient_accumulation_steps``
and averages gradients over data-parallel ranks; the adapter multiplies each
microbatch's ``loss_sum`` by ``dp * gas / global_count`` (see :mod:`.common`), so
the step is the global batch's per-token (or per-sample) mean.

ZeRO reduction order: DeepSpeed 0.19.8's ZeRO-2 reduces every microbatch from
per-parameter gradient hooks (``runtime/zero/stage_1_and_2.py:1379``, ``:2284``):
each gradient is copied into a flat bucket at the next free offset (``:1455``)
and its parameter appended to the bucket's list (``:1473``) in the order the
hooks fire; ``reduce_ipg_grads`` (``:2229``) then ``average_tensor`` reduces that
bucket slice by slice from the local list (``:1635``-``:1692``), so element i of
one rank's bucket is added to element i of the other's. That holds only if all
ranks run the same autograd graph. Balanced microbatches do not: another mix of
modalities, encoder outputs deferred from an earlier microbatch, and the hooks
fire in another order; one parameter's gradient was summed with another's
(ZeRO-2, 3 microbatches: gradients off by ~1e-2, parameters by ~2e-3 after 3
steps). ZeRO-1 with ``overlap_comm`` reduces from the same hooks (``:2290``).
:func:`train_step` therefore runs the microbatches of an iteration inside
``engine.coalesce_grad_reduction()`` (``runtime/engine.py:3239``): gradients
accumulate locally and one flush reduces them in parameter order on every rank
(``runtime/engine.py:3300``). Cost: until the step a rank holds its whole local
gradient, as ZeRO-1 does, instead of ZeRO-2's partition plus bucket.

Pipelines: balanced microbatches change shape from one microbatch to the next.
``PipelineModule(dynamic_shape=False)`` exchanges activation shapes once; a
larger later microbatch then crashes in gloo and a smaller one silently reads
a stale buffer, so :func:`check_pipeline_engine` refuses it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..batch import Microbatch
from ..errors import InvalidInput, PlanError
from ..plan import ParallelPlan
from .common import (
    EncoderOutputBuffer,
    global_loss_count,
    iteration_microbatches,
    loss_scale,
    loss_sums,
    resolve_encoder_calls,
)
from .deepspeed_config import ZERO_STAGE, deepspeed_config
from .reference_model import ReferenceMLLM, packed_causal_mask

__all__ = [
    "ZERO_STAGE",
    "avoid_cpu_op_builds",
    "deepspeed_config",
    "pipeline_parts",
    "PlannedPipelineModule",
    "check_pipeline_engine",
    "train_step",
    "PipelineFeeder",
]

log = logging.getLogger(__name__)


def avoid_cpu_op_builds() -> None:
    """On CPU, stop DeepSpeed from compiling its shared-memory comm op at init (a one-time C++
    build of minutes); torch.distributed's gloo collectives are used instead. Call before
    ``deepspeed.init_distributed`` / ``deepspeed.initialize``."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def pipeline_parts(plan: ParallelPlan, first_extra: int = 1, last_extra: int = 1) -> list[int]:
    """PipelineModule ``parts`` (stage boundaries in its layer list) from the plan's layer ranges.

    The layer list is ``first_extra`` input layers (encoders + embedding), the
    LLM blocks, then ``last_extra`` output layers (norm + head).
    """
    ranges = plan.llm_layer_ranges(
        "deepspeed adapter",
        hint="DeepSpeed's PipelineModule is one layer sequence, so place the encoders on the "
        "first LLM stage (plan a 'mixed' first stage) or use the Megatron adapter",
    )
    parts = [0] + [first_extra + end for _, end in ranges]
    parts[-1] += last_extra
    return parts


class PlannedPipelineModule:
    """A DeepSpeed ``PipelineModule`` split at the plan's stage boundaries (``parts``).

    DeepSpeed 0.19.8 partitions only by ``uniform``/``parameters``/``type:``;
    the plan's layer ranges are set as ``parts`` directly. Built lazily so that
    importing this module does not import DeepSpeed.
    """

    def __new__(cls, layers: Sequence[nn.Module], *, plan: ParallelPlan, **kwargs: Any) -> Any:
        from deepspeed.pipe import PipelineModule

        parts = pipeline_parts(plan)
        if parts[-1] != len(layers):
            raise PlanError(
                f"deepspeed adapter: the plan's stages cover {parts[-1]} pipeline layers "
                f"but the model has {len(layers)}"
            )

        class _Planned(PipelineModule):
            def _partition_layers(self, method: str = "uniform") -> None:
                stage = self._topo.get_coord(self.global_rank).pipe
                self.parts = list(parts)
                self._set_bounds(start=parts[stage], stop=parts[stage + 1])

        return _Planned(layers=list(layers), num_stages=plan.pp, **kwargs)


def check_pipeline_engine(engine: Any) -> None:
    """Refuse a pipeline engine whose module was built with ``dynamic_shape=False``."""
    if not getattr(engine.module, "dynamic_shape", False):
        raise InvalidInput(
            "deepspeed PipelineModule(dynamic_shape=False) cannot take balanced microbatches: "
            "their shapes vary, and with fixed shapes a larger microbatch crashes the "
            "send/recv while a smaller one silently reads a stale buffer. Build the "
            "PipelineModule with dynamic_shape=True"
        )


def _dp_group(engine: Any) -> Any:
    grid = getattr(engine, "grid", None)
    if grid is not None:
        return grid.get_data_parallel_group()
    import deepspeed.comm  # noqa: F401  (DeepSpeed's default group is torch's)

    return getattr(engine, "seq_data_parallel_group", None) or getattr(
        engine, "data_parallel_group", None
    )


def _zero_fill_missing_grads(optimizer: Any) -> None:
    """Give every trainable parameter a gradient before the coalesced flush.

    DeepSpeed's flush skips a parameter whose gradient is None
    (``runtime/engine.py:3322``) and packs the others into one flat bucket
    that is reduced position by position; a parameter that got no gradient in
    the whole step on one rank only (an encoder no microbatch of that replica
    used, without a dummy touch) would shift every later gradient on that rank.
    A zero gradient contributes nothing and keeps the layout the same on every
    rank (what DeepSpeed does itself for ZeRO-0, ``runtime/engine.py:3857``).
    """
    get = getattr(optimizer, "get_gradient_for_reduction", None)
    groups = getattr(optimizer, "bit16_groups", None)
    if get is None or groups is None:  # ZeRO-3 (fp16_groups, partitioned grads): not handled
        return
    in_accum = bool(getattr(optimizer, "use_grad_accum_attribute", False))
    dtype = getattr(optimizer, "gradient_accumulation_dtype", None)
    for group in groups:
        for p in group:
            if p.requires_grad and p.numel() and get(p) is None:
                if in_accum:
                    p.grad_accum = torch.zeros_like(p, dtype=dtype or p.dtype)
                else:
                    p.grad = torch.zeros_like(p)


def _discard_gradients(engine: Any) -> None:
    """Drop the gradients a failed iteration accumulated, so the next one starts clean."""
    zero_grad = getattr(engine.optimizer, "zero_grad", None)
    if zero_grad is not None:
        zero_grad()
    engine.zero_grad()


def train_step(
    engine: Any,
    microbatches: Sequence[Microbatch],
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    *,
    mode: str = "token",
    buffer: EncoderOutputBuffer | None = None,
    uniform_encoder_calls: bool | None = None,
) -> float:
    """One iteration on a plain DeepSpeed engine (ZeRO 0-3); returns the global-batch mean loss.

    ``forward(engine, mb, buffer)`` defaults to ``engine(mb, buffer, mode=mode)``.
    ``uniform_encoder_calls`` (None: under ZeRO-3, which all-gathers a module's
    parameters at every call): every rank calls each encoder the group-wide
    number of times per microbatch (:mod:`entrain_data.encoder_calls`).

    ZeRO 1-3: all microbatches inside ``engine.coalesce_grad_reduction()``, then
    one ``step()``, so gradients are reduced once, in parameter order, whatever
    order each rank's hooks fire in (see the module notes: per-microbatch ZeRO-2
    reduction follows hook order, which balanced microbatches make differ
    between ranks). ZeRO-0 reduces once per step in parameter order already; its
    accumulation boundary is set explicitly on the last microbatch (not left to DeepSpeed's
    micro-step counter, which an iteration that failed part-way would leave shifted). A
    failed iteration's gradients are discarded.
    """
    microbatches = iteration_microbatches(microbatches, "deepspeed train_step")
    gas = engine.gradient_accumulation_steps()
    if len(microbatches) != gas:
        raise InvalidInput(
            f"deepspeed train_step: {len(microbatches)} microbatches but the engine's "
            f"gradient_accumulation_steps is {gas}; build the config with deepspeed_config(plan)"
        )
    coalesce = engine.zero_optimization_stage() >= 1
    if coalesce and not hasattr(engine, "coalesce_grad_reduction"):
        raise InvalidInput(
            "deepspeed train_step: ZeRO stage >= 1 needs engine.coalesce_grad_reduction() "
            "(DeepSpeed 0.19.8 has it): per-microbatch ZeRO reduction follows each rank's "
            "hook order, which balanced microbatches make differ between ranks"
        )
    if coalesce and not hasattr(engine.optimizer, "_coalesce_grad_reduction"):
        # runtime/engine.py:3262: BF16_Optimizer / FP16_Optimizer wrappers (DeepSpeed picks
        # BF16_Optimizer for bf16 with ZeRO-1 and an fp32 grad_accum_dtype, engine.py:2305)
        # bypass the hooks the coalesced flush needs
        raise InvalidInput(
            "deepspeed train_step: the engine's optimizer wrapper "
            f"{type(engine.optimizer).__name__} cannot coalesce the ZeRO gradient reduction "
            "(bf16 with ZeRO-1 and data_types.grad_accum_dtype=fp32 gives BF16_Optimizer); "
            "use ZeRO stage 2 or 3 (fp32 accumulation of the partition), or ZeRO-1 with "
            'grad_accum_dtype "bf16"'
        )
    buffer = buffer if buffer is not None else EncoderOutputBuffer()
    buffer.expect(microbatches)  # deferred samples bound for one microbatch share an encoder call
    group = _dp_group(engine)
    if uniform_encoder_calls is None:
        uniform_encoder_calls = engine.zero_optimization_stage() == 3
    if uniform_encoder_calls:
        microbatches = resolve_encoder_calls(microbatches, group=group, device=engine.device)
    dp = engine.dp_world_size
    count = global_loss_count(microbatches, mode, group, engine.device)
    scale = loss_scale(count, dp=dp, accumulation=gas)
    total = torch.zeros((), dtype=torch.float64, device=engine.device)  # reduced over group
    before = getattr(engine, "_is_gradient_accumulation_boundary", None)
    try:
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for j, mb in enumerate(microbatches):
                if not coalesce:  # ZeRO-0: the last microbatch reduces and updates, always
                    engine.set_gradient_accumulation_boundary(j == len(microbatches) - 1)
                mb = mb.to(engine.device)
                if forward is None:
                    loss_sum, _ = engine(mb, buffer, mode=mode)
                else:
                    loss_sum, _ = forward(engine, mb, buffer)
                engine.backward(loss_sum * scale)  # DeepSpeed divides by gas: scale has it
                if not coalesce:
                    engine.step()  # ZeRO-0: updates only at the boundary set above
                total += loss_sum.detach().double()
            if coalesce:
                _zero_fill_missing_grads(engine.optimizer)
    except BaseException:
        buffer.clear()  # a failed step's outputs (and their graphs) must not reach the next
        _discard_gradients(engine)
        raise
    finally:
        if not coalesce:
            engine.set_gradient_accumulation_boundary(before)
    buffer.check_drained(microbatches[0].iteration)
    if coalesce:
        # The flush restores the boundary flag it found on entry (runtime/engine.py:3298) and
        # the engine's own boundary is every gas-th step() call (:3463); here one step()
        # ends the iteration, so mark it, then put the flag back.
        before = getattr(engine, "_is_gradient_accumulation_boundary", None)
        engine.set_gradient_accumulation_boundary(True)
        try:
            engine.step()
        finally:
            engine.set_gradient_accumulation_boundary(before)
    if dp > 1:
        torch.distributed.all_reduce(total, group=group)
    return float(total) / count


# ------------------------------------------------------------- pipeline feeding
class _InputLayer(nn.Module):
    """First pipe layer: encoders + embedding of microbatch ``index`` (taken from the feeder)."""

    def __init__(self, model: ReferenceMLLM, feeder: PipelineFeeder):
        super().__init__()
        self.vision, self.audio, self.tok_embed = model.vision, model.audio, model.tok_embed
        self._model = [model]  # not a submodule: its parameters are owned by the layers
        self._feeder = [feeder]

    def forward(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model, feeder = self._model[0], self._feeder[0]
        mb = feeder.current[int(index)]
        return model.embed_microbatch(mb, feeder.buffer), mb["cu_seqlens"].long()


class _BlockLayer(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, cu = inputs
        return self.block(x, packed_causal_mask(cu)), cu


class _HeadLayer(nn.Module):
    def __init__(self, model: ReferenceMLLM):
        super().__init__()
        self.norm, self.lm_head = model.norm, model.lm_head

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, cu = inputs
        return self.lm_head(self.norm(x)), cu


class PipelineFeeder:
    """Feeds one iteration's balanced microbatches to a DeepSpeed ``PipelineEngine``.

    ``layers()`` cuts the reference model into pipe layers: [encoders +
    embedding, LLM blocks..., norm + head]; the first stage reads the real
    :class:`Microbatch` (keys, pixels, audio) from this feeder by index, so
    deferred samples' encoder outputs stay in its buffer on that stage. The
    last stage's ``loss_fn`` returns ``loss_sum * dp * gas / global_count``.
    """

    def __init__(self, model: ReferenceMLLM, mode: str = "token", budget: int | None = None):
        self.model, self.mode = model, mode
        self.buffer = EncoderOutputBuffer(budget)
        self.current: list[Microbatch] = []
        self.scale = 0.0
        self.loss_sum = torch.zeros((), dtype=torch.float64)

    def layers(self) -> list[nn.Module]:
        m = self.model
        return [_InputLayer(m, self), *(_BlockLayer(b) for b in m.layers), _HeadLayer(m)]

    def loss_fn(
        self, outputs: tuple[torch.Tensor, torch.Tensor], labels: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        logits, cu = outputs
        loss_sum, _ = loss_sums(logits, labels[0], labels[1], self.mode)
        self.loss_sum += loss_sum.detach().double().cpu()
        return loss_sum * self.scale

    def _data(self, microbatches: Sequence[Microbatch]) -> Iterator[tuple]:
        for j, mb in enumerate(microbatches):
            yield torch.tensor(j), (mb["labels"], mb["cu_seqlens"].long())

    def train_batch(self, engine: Any, microbatches: Sequence[Microbatch]) -> float:
        """One iteration through ``engine.train_batch``; returns the global-batch mean loss
        (on the last stage; other stages return NaN)."""
        check_pipeline_engine(engine)
        microbatches = iteration_microbatches(microbatches, "deepspeed pipeline")
        gas = engine.gradient_accumulation_steps()
        if len(microbatches) != gas:
            raise InvalidInput(
                f"deepspeed pipeline: {len(microbatches)} microbatches but "
                f"gradient_accumulation_steps is {gas}"
            )
        group = engine.grid.get_data_parallel_group()
        dp = engine.grid.get_data_parallel_world_size()
        count = global_loss_count(microbatches, self.mode, group, engine.device)
        self.scale = loss_scale(count, dp=dp, accumulation=gas)
        self.current = [mb.to(engine.device) for mb in microbatches]
        self.buffer.expect(self.current)  # deferred samples bound for one microbatch: one call
        self.loss_sum.zero_()
        try:
            engine.train_batch(data_iter=self._data(self.current))
        except BaseException:
            self.buffer.clear()
            self.current = []
            raise
        if engine.is_first_stage():
            self.buffer.check_drained(microbatches[0].iteration)
        self.current = []
        if not engine.is_last_stage():
            return float("nan")
        total = self.loss_sum.to(engine.device, copy=True)  # on the group's device
        if dp > 1:
            torch.distributed.all_reduce(total, group=group)
        return float(total) / count
