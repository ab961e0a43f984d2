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

torch.distributed.pipelining (1F1B), with the reference model cut at the plan's stages::

    mesh = device_mesh_from_plan(plan)
    pipe = PipelineTrainer(model, plan, mesh)             # this rank's stage, Schedule1F1B
    optimizer = torch.optim.SGD(pipe.module.parameters(), lr=lr)
    for mbs in group_iterations(loader):
        res = pipe.train_step(mbs)                        # res.padding_fraction: padding sent
        optimizer.step(); optimizer.zero_grad()

A torch 2.13 schedule allocates its receive buffers from one shape, so each
step pads the activations crossing stages to the step's longest microbatch
(balanced microbatches keep that small) and runs a schedule built, and cached,
for that length. Padding never reaches a computation: every stage drops it
before its layers and re-pads its output, and the loss is masked on it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
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
    require_world,
    resolve_encoder_calls,
)
from .reference_model import ReferenceMLLM, Segments

__all__ = [
    "device_mesh_from_plan",
    "StepResult",
    "accumulate_gradients",
    "fsdp_per_module",
    "ForwardFn",
    "StageLayers",
    "stage_layers_from_plan",
    "padded_length",
    "ReferenceStage",
    "PipelineStepResult",
    "PipelineTrainer",
]

log = logging.getLogger(__name__)

ForwardFn = Callable[
    [nn.Module, Microbatch, EncoderOutputBuffer], tuple[torch.Tensor, torch.Tensor]
]
"""``forward(model, mb, buffer) -> (loss_sum, loss_count)`` summed as ``mode`` says;
default ``model(mb, buffer, mode=mode)`` (the reference model's signature)."""


def device_mesh_from_plan(plan: ParallelPlan, device_type: str = "cpu") -> Any:
    """A 3-D ``DeviceMesh`` named ``("pp", "dp", "tp")`` laid out as the plan's ``rank_coords``
    (tensor-parallel fastest, then data-parallel, then pipeline: Megatron's order)."""
    from torch.distributed.device_mesh import init_device_mesh

    require_world(plan, "device_mesh_from_plan")
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


def fsdp_per_module(model: nn.Module) -> bool:
    """True when FSDP2 ``fully_shard`` wraps a submodule of ``model`` (not only the root)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules() if m is not model)


def accumulate_gradients(
    model: nn.Module,
    microbatches: Sequence[Microbatch],
    forward: ForwardFn | None = None,
    *,
    mode: str = "token",
    dp_group: dist.ProcessGroup | None = None,
    buffer: EncoderOutputBuffer | None = None,
    device: torch.device | str | None = None,
    uniform_encoder_calls: bool | None = None,
) -> StepResult:
    """Forward and backward every microbatch of one iteration; gradients end DP-synchronised.

    ``microbatches``: this rank's microbatches of one iteration, in order
    (deferred samples are encoded before they are consumed). ``dp_group``: the
    data-parallel group the wrapper averages over (None: the default group).
    ``uniform_encoder_calls``: make every rank call each encoder the same
    group-wide number of times per microbatch (:mod:`entrain_data.encoder_calls`);
    None: when FSDP2 shards a submodule on its own (per-block wrapping), which
    all-gathers at every call. ``device``: where microbatches, loss count and loss sum go (None:
    the model's; NCCL reduces only CUDA tensors). The optimizer step is the caller's.
    """
    microbatches = iteration_microbatches(microbatches, "accumulate_gradients")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if uniform_encoder_calls is None:
        uniform_encoder_calls = fsdp_per_module(model)
    if uniform_encoder_calls:
        microbatches = resolve_encoder_calls(microbatches, group=dp_group, device=device)
    if forward is None:

        def forward(model: nn.Module, mb: Microbatch, buffer: EncoderOutputBuffer) -> Any:
            return model(mb, buffer, mode=mode)

    buffer = buffer if buffer is not None else EncoderOutputBuffer()
    buffer.expect(microbatches)  # deferred samples bound for one microbatch share an encoder call
    on = dist.is_available() and dist.is_initialized()
    dp = dist.get_world_size(dp_group) if on else 1
    count = global_loss_count(microbatches, mode, dp_group, device)
    scale = loss_scale(count, dp=dp)
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    try:
        for j, mb in enumerate(microbatches):
            last = j == len(microbatches) - 1
            with _sync_context(model, last):
                loss_sum, _ = forward(model, mb.to(device), buffer)
                (loss_sum * scale).backward()
            total += loss_sum.detach().double()
            tokens += mb.num_tokens
    except BaseException:
        buffer.clear()  # a failed step's outputs (and their graphs) must not reach the next
        raise
    buffer.check_drained(microbatches[0].iteration)
    if on and dp > 1:
        dist.all_reduce(total, group=dp_group)
    return StepResult(float(total) / count, count, len(microbatches), tokens)


# ------------------------------------------------------------------ pipelining (1F1B)
@dataclass(frozen=True)
class StageLayers:
    """What pipeline stage ``stage`` holds of the reference model: LLM blocks ``[start, end)``,
    plus the encoders and embedding when ``first`` and the final norm and LM head when ``last``."""

    stage: int
    num_stages: int
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def stage_layers_from_plan(plan: ParallelPlan, stage: int) -> StageLayers:
    """Stage ``stage``'s LLM layer range from the plan.

    The encoders ride on the first stage: the embedding needs their outputs, and
    deferred samples' outputs wait in a buffer where the encoders run. A stage
    without LLM layers, encoders elsewhere or non-contiguous ranges are refused
    (:meth:`ParallelPlan.llm_layer_ranges`).
    """
    if len(plan.stages) != plan.pp or not 0 <= stage < plan.pp:
        raise PlanError(
            f"torch pipelining: stage {stage} of a plan with pp={plan.pp} "
            f"and {len(plan.stages)} stages"
        )
    ranges = plan.llm_layer_ranges(
        "torch pipelining",
        hint="the reference stages carry the encoders on the first LLM stage "
        "(plan a 'mixed' first stage)",
    )
    return StageLayers(stage, plan.pp, *ranges[stage])


def padded_length(lengths: Sequence[int], multiple: int = 1) -> int:
    """The step's common sequence length: its longest microbatch, rounded up to ``multiple``
    (a coarser multiple lets more steps share one cached schedule, at more padding)."""
    if multiple < 1:
        raise InvalidInput(f"pad multiple must be >= 1, got {multiple}")
    longest = max(lengths, default=0)
    return max(multiple, -(-longest // multiple) * multiple)


class ReferenceStage(nn.Module):
    """One pipeline stage of :class:`ReferenceMLLM` over fixed-shape, padded activations.

    Between stages an activation is ``(hidden [1, L, H], segment [1, L])``: L is
    the step's padded length, ``segment`` each token's sample index and -1 on
    padding, which always trails. Every stage drops the padding before its
    layers and re-pads what it outputs, so padding enters no attention, norm or
    loss and its gradient is exactly zero. The first stage's input is a
    microbatch index ``[1]``: it reads the real :class:`Microbatch` from its
    trainer, so the encoders see unpadded images and audio and deferred
    samples' outputs stay in the trainer's buffer. Every module the stage
    runs is registered here: the optimizer and the schedule's gradient
    handling see exactly this stage's parameters.
    """

    def __init__(self, model: ReferenceMLLM, layers: StageLayers, trainer: PipelineTrainer):
        super().__init__()
        if layers.end > len(model.layers) or (layers.last and layers.end != len(model.layers)):
            raise PlanError(
                f"torch pipelining: stage {layers.stage} holds LLM layers "
                f"[{layers.start}, {layers.end}) but the model has {len(model.layers)}"
            )
        self.spec = layers
        self._model = [model]  # for its methods; the parameters are registered below
        self._trainer = [trainer]
        if layers.first:
            self.vision, self.audio, self.tok_embed = model.vision, model.audio, model.tok_embed
        self.blocks = nn.ModuleList(model.layers[layers.start : layers.end])
        if layers.last:
            self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model, trainer = self._model[0], self._trainer[0]
        if self.spec.first:
            (index,) = inputs
            mb = trainer.current[int(index)]
            x = model.embed_microbatch(mb, trainer.buffer)
            lengths = torch.diff(mb["cu_seqlens"].long())
            segment = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
            length = trainer.length
        else:
            hidden, padded_segment = inputs
            segment = padded_segment[0][padded_segment[0] >= 0]
            x = hidden[0, : segment.numel()]
            lengths = torch.bincount(segment)
            length = hidden.shape[1]
        mask = Segments([n for n in lengths.tolist() if n > 0], causal=True)
        for block in self.blocks:
            x = block(x, mask)
        if self.spec.last:
            x = self.lm_head(self.norm(x))
        pad = length - x.shape[0]
        if pad < 0:
            raise InvalidInput(f"torch pipelining: {x.shape[0]} tokens exceed the padded {length}")
        return F.pad(x, (0, 0, 0, pad)).unsqueeze(0), F.pad(segment, (0, pad), value=-1)[None]

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the whole model's names (what a
        non-pipelined checkpoint calls them), so the stages' states merge into one."""
        mine = {id(t) for t in self.state_dict(keep_vars=True).values()}
        return {
            k: v.detach()
            for k, v in self._model[0].state_dict(keep_vars=True).items()
            if id(v) in mine
        }


@dataclass(frozen=True)
class PipelineStepResult(StepResult):
    """A pipelined iteration's outcome on this rank; ``loss`` is NaN except on the last stage.

    ``padding_fraction``: share of the activation rows sent between stages that
    are padding, ``1 - tokens / (microbatches * padded_length)``."""

    padded_length: int
    padding_fraction: float


class PipelineTrainer:
    """This rank's stage of one replica's pipeline, trained with torch's ``Schedule1F1B``.

    Balanced microbatches differ in length, while a torch 2.13 schedule sizes
    its receive buffers once, from one shape. So each step pads every
    microbatch's activations to :func:`padded_length` and runs a schedule
    built for that length, cached (at most ``max_schedules``) so recurring
    lengths cost nothing to set up. Schedules are built with their shapes given
    (static metadata): no forward is run to infer them, which would encode
    microbatch 0's deferred samples twice, and no metadata is pickled between ranks.

    Loss: ``Schedule1F1B`` backpropagates each microbatch's ``loss_fn`` value
    as is and, with ``scale_grads=True`` (its default), divides every gradient
    of the stage by ``n_microbatches`` afterwards. The schedules here use
    ``scale_grads=False`` and ``loss_fn`` returns ``loss_sum * dp / global_count``,
    so the step is the global batch's per-token (or per-sample) mean whatever
    the microbatch sizes. For data parallelism wrap :attr:`module` (DDP or
    FSDP2) before the first step; the schedule syncs it after the last backward.

    ``mesh``: the plan's ``("pp", "dp", "tp")`` mesh (default: built from the
    plan when torch.distributed runs); ``stage``: only without
    torch.distributed, to run a stage by hand; ``budget``: the deferral buffer's
    (``plan.defer_budget``); ``pad_multiple``: see :func:`padded_length`.
    """

    def __init__(
        self,
        model: ReferenceMLLM,
        plan: ParallelPlan,
        mesh: Any | None = None,
        *,
        stage: int | None = None,
        mode: str = "token",
        budget: int | None = None,
        device: torch.device | str = "cpu",
        pad_multiple: int = 1,
        max_schedules: int = 8,
    ):
        if mesh is None and dist.is_available() and dist.is_initialized():
            mesh = device_mesh_from_plan(plan, torch.device(device).type)
        if mesh is not None:  # the pp group carries activations, the dp group the loss count
            self.group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
            here = mesh["pp"].get_local_rank()
            if stage is not None and stage != here:
                raise InvalidInput(f"PipelineTrainer: stage={stage} but this rank is stage {here}")
            stage = here
        elif stage is None:
            raise InvalidInput(
                "PipelineTrainer: torch.distributed is not initialised; pass stage= to run "
                "a stage by hand"
            )
        else:
            self.group = self.dp_group = None
        padded_length([], pad_multiple)  # validates the multiple
        self.plan, self.mode, self.device = plan, mode, torch.device(device)
        self.pad_multiple, self.max_schedules = pad_multiple, max_schedules
        self.spec = stage_layers_from_plan(plan, stage)
        self.module: nn.Module = ReferenceStage(model, self.spec, self)
        self.buffer = EncoderOutputBuffer(budget)
        self.current: list[Microbatch] = []
        self.length = 0
        self.schedules_built = 0
        self._schedules: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._dtype = model.tok_embed.weight.dtype
        self._widths = (model.config.hidden, model.config.vocab)
        self._scale, self._count = 0.0, 0
        self._loss_sum = torch.zeros((), dtype=torch.float64)

    # ----------------------------------------------------------- per step
    def load(self, microbatches: Sequence[Microbatch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Make ``microbatches`` the current step: sets the padded length and the loss scale;
        returns the first stage's inputs (indices ``[M]``) and the labels padded with -100
        ``[M, L]`` (the last stage's target: padding carries no loss)."""
        dp = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        microbatches = iteration_microbatches(microbatches, "PipelineTrainer")
        self._count = global_loss_count(microbatches, self.mode, self.dp_group, self.device)
        self._scale = loss_scale(self._count, dp=dp)
        self.length = padded_length([mb.num_tokens for mb in microbatches], self.pad_multiple)
        self.current = [mb.to(self.device) for mb in microbatches]
        if self.spec.first:  # deferred samples bound for one microbatch: one encoder call
            self.buffer.expect(self.current)
        labels = torch.full((len(microbatches), self.length), -100, dtype=torch.int64)
        for j, mb in enumerate(self.current):
            if "labels" in mb:
                labels[j, : mb.num_tokens] = mb["labels"]
        return torch.arange(len(microbatches), device=self.device), labels.to(self.device)

    def loss_fn(
        self, outputs: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor
    ) -> torch.Tensor:
        """One microbatch's ``loss_sum`` times the step's scale, masked on padding (labels -100;
        the padding is one trailing segment without loss tokens, so it counts in neither mode)."""
        logits, segment = outputs
        lengths = torch.bincount(segment[0] + 1, minlength=1)  # [padding, sample 0, ...]
        cu = F.pad(torch.cumsum(torch.cat([lengths[1:], lengths[:1]]), 0), (1, 0))
        loss_sum, _ = loss_sums(logits[0], target[0], cu, self.mode)
        self._loss_sum += loss_sum.detach().double().cpu()
        return loss_sum * self._scale

    def train_step(self, microbatches: Sequence[Microbatch]) -> PipelineStepResult:
        """Forward and backward one iteration through the 1F1B schedule; the optimizer step is
        the caller's. Every pipeline rank of a replica passes the same microbatches."""
        if isinstance(microbatches, Iterable):  # a generator is read once, here
            microbatches = list(microbatches)
        n = len(microbatches) if isinstance(microbatches, list) else 0
        if n < self.spec.num_stages:
            raise InvalidInput(
                f"torch pipelining: {n} microbatches for {self.spec.num_stages} stages; "
                "1F1B needs at least one per stage"
            )
        indices, labels = self.load(microbatches)
        schedule = self._schedule(self.length, n)
        self._loss_sum.zero_()
        losses: list[torch.Tensor] = []
        args = (indices,) if self.spec.first else ()
        target = labels if self.spec.last else None
        try:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
            if self.spec.first:
                self.buffer.check_drained(microbatches[0].iteration)
        except BaseException:
            self.buffer.clear()  # a failed step must not leave graphs for the next
            raise
        finally:
            self.current = []
        tokens = sum(mb.num_tokens for mb in microbatches)
        count, loss = self._count, float("nan")
        if self.spec.last:
            total = self._loss_sum.to(self.device, copy=True)  # on the group's device
            if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
                dist.all_reduce(total, group=self.dp_group)
            loss = float(total) / count
        return PipelineStepResult(
            loss, count, n, tokens, self.length, 1.0 - tokens / (n * self.length)
        )

    def _schedule(self, length: int, n: int) -> Any:
        """The 1F1B schedule for ``n`` microbatches of ``length`` rows (built on first use)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        key = (length, n)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        hidden, vocab = self._widths

        def act(width: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.empty(1, length, width, dtype=self._dtype, device="meta", requires_grad=True)
            return x, torch.empty(1, length, dtype=torch.int64, device="meta")

        inputs = (
            (torch.empty(1, dtype=torch.int64, device="meta"),) if self.spec.first else act(hidden)
        )
        stage = PipelineStage(
            self.module,
            self.spec.stage,
            self.spec.num_stages,
            self.device,
            input_args=inputs,
            output_args=act(vocab if self.spec.last else hidden),
            group=self.group,
        )
        schedule = Schedule1F1B(stage, n, loss_fn=self.loss_fn, scale_grads=False)
        self._schedules[key] = schedule
        self.schedules_built += 1
        while len(self._schedules) > self.max_schedules:
            self._schedules.popitem(last=False)
        log.debug(
            "torch pipelining: stage %d built a 1F1B schedule for %d x %d rows",
            self.spec.stage,
            n,
            length,
        )
        return schedule
