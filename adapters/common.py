"""Framework-independent mechanics every adapter shares.

*Loss normalisation.* Balanced microbatches differ in size, so "mean loss per
microbatch, averaged over microbatches and replicas" (what frameworks do by
default) weights tokens unequally and is *not* the loss of the global batch.
The loss we train on is the per-token (or per-sample) mean over the whole
global batch: every rank computes ``loss_sum`` per microbatch, the global count
is all-reduced over the DP group once per iteration (it is known before any
forward: the labels arrive with the microbatches), and each microbatch's
``loss_sum`` is scaled by ``dp * accumulation / global_count`` where ``dp`` and
``accumulation`` undo the framework's own gradient averaging over replicas and
accumulation steps.

*Encoder-output buffer.* A sample encoded in microbatch i and consumed by the
LLM in microbatch j > i (deferral) waits in :class:`EncoderOutputBuffer`, keyed
by sample key and bounded by the plan's budget. For a trainable encoder the
stored tensor keeps its own autograd graph (each deferred sample is encoded
on its own), so its encoder backward runs once, when the consuming
microbatch's gradient arrives (split backward); for a frozen encoder only the
output is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch import Microbatch
from ..errors import InvalidInput

__all__ = [
    "LOSS_MODES",
    "loss_sums",
    "loss_units",
    "global_loss_count",
    "loss_scale",
    "EncoderOutputBuffer",
    "group_iterations",
    "require_world",
]

log = logging.getLogger(__name__)

LOSS_MODES = ("token", "sample")
"""``token``: mean over every loss token of the global batch; ``sample``: mean over samples of
each sample's own token mean."""


def _check_mode(mode: str) -> None:
    if mode not in LOSS_MODES:
        raise InvalidInput(f"loss mode {mode!r}: choose one of {', '.join(LOSS_MODES)}")


def loss_sums(
    logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor, mode: str = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, loss_count)`` of a packed sequence; ``labels`` ``-100`` carry no loss.

    ``token``: sum of token losses and the number of loss tokens. ``sample``:
    sum over samples of their mean token loss and the number of samples with a
    loss token. Dividing the sums over a global batch by the counts over it
    gives that batch's mean, whatever the microbatching.
    """
    _check_mode(mode)
    tok = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")
    valid = labels != -100
    if mode == "token":
        return tok.sum(), valid.sum().to(tok.dtype)
    lengths = torch.diff(cu_seqlens.long())
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=tok.device), lengths)
    per_sum = torch.zeros(len(lengths), dtype=tok.dtype, device=tok.device).index_add(0, owner, tok)
    per_n = torch.zeros(len(lengths), dtype=tok.dtype, device=tok.device).index_add(
        0, owner, valid.to(tok.dtype)
    )
    has = per_n > 0
    return (per_sum[has] / per_n[has]).sum(), has.sum().to(tok.dtype)


def loss_units(mb: Microbatch, mode: str = "token") -> int:
    """This microbatch's share of the loss denominator (loss tokens, or samples with a loss token)."""
    _check_mode(mode)
    if "labels" not in mb:
        return 0
    valid = mb["labels"] != -100
    if mode == "token":
        return int(valid.sum())
    lengths = torch.diff(mb["cu_seqlens"].long())
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths.cpu())
    return int(torch.bincount(owner[valid.cpu()], minlength=len(lengths)).gt(0).sum())


def global_loss_count(
    microbatches: Sequence[Microbatch],
    mode: str = "token",
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """The loss denominator of the whole global batch: this replica's count summed over ``group``.

    ``microbatches`` are this replica's microbatches of one iteration; ``group``
    is the data-parallel group (None: the default group when initialised; no
    communication when not). Pipeline and tensor-parallel ranks of a replica
    see the same microbatches, so they must not be in ``group``.
    """
    local = sum(loss_units(mb, mode) for mb in microbatches)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(t, group=group)
        return int(t.item())
    return local


def require_world(plan: Any, who: str) -> None:
    """Refuse to lay out ``plan`` unless torch.distributed runs exactly ``plan.world_size`` ranks:
    every adapter maps global ranks through ``plan.rank_coords``, which assumes that world."""
    if not dist.is_initialized():
        raise InvalidInput(f"{who}: torch.distributed is not initialised")
    if dist.get_world_size() != plan.world_size:
        raise InvalidInput(
            f"{who}: plan.world_size={plan.world_size}, but {dist.get_world_size()} ranks run"
        )


def loss_scale(global_count: int, *, dp: int = 1, accumulation: int = 1) -> float:
    """Factor on each microbatch's ``loss_sum`` that makes the framework's averaged gradient
    equal the gradient of ``(sum of loss_sum over the global batch) / global_count``.

    ``dp``: the framework divides gradients by the DP size (DDP, ZeRO, FSDP);
    ``accumulation``: it divides each microbatch's loss by the number of
    accumulation steps (DeepSpeed). Pass 1 for what the framework does not do.
    """
    if global_count <= 0:
        raise InvalidInput(
            f"global batch has no loss tokens (global_count={global_count}): nothing to train on"
        )
    return float(dp * accumulation) / float(global_count)


class EncoderOutputBuffer:
    """Encoder outputs of deferred samples, keyed by sample key, bounded by a token budget.

    ``budget`` counts encoder output rows held at once (None: unbounded). A
    plan's ``defer_budget`` counts the deferred samples' LLM tokens, which
    include their encoder tokens, so ``EncoderOutputBuffer(plan.defer_budget)``
    never refuses what the assignment allowed. Samples never leave their
    iteration: :meth:`pop` checks it, :meth:`check_drained` ends one.
    """

    def __init__(self, budget: int | None = None):
        if budget is not None and budget < 0:
            raise InvalidInput(f"encoder-output buffer: budget must be >= 0, got {budget}")
        self.budget = budget
        self._items: dict[str, tuple[torch.Tensor, int]] = {}
        self._tokens = 0
        self.peak_tokens = 0
        self._consumer: dict[tuple[int, str], int] = {}

    def expect(self, microbatches: Iterable[Microbatch]) -> None:
        """Learn, from one iteration's microbatches, which microbatch consumes each deferred sample.

        Deferred samples bound for the same consumer can then share one encoder
        call (:meth:`consumer`): their backward still runs exactly once, with that
        consumer's. Without it every deferred sample is encoded on its own.
        """
        # replaces, not merges: only the iteration being run matters, and a step that
        # failed half-way must not leave its announcements to a later one
        self._consumer = {
            (mb.iteration, key): mb.microbatch for mb in microbatches for key in mb.deferred_in
        }

    def consumer(self, key: str, iteration: int) -> int | None:
        """The microbatch that will consume deferred ``key`` (None: not announced by :meth:`expect`)."""
        return self._consumer.get((iteration, key))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    @property
    def tokens(self) -> int:
        """Encoder output rows held now."""
        return self._tokens

    def keys(self) -> list[str]:
        return list(self._items)

    def put(self, key: str, output: torch.Tensor, iteration: int = 0) -> None:
        """Hold ``output`` (with its graph when it requires grad) until :meth:`pop`."""
        if key in self._items:
            raise InvalidInput(f"encoder-output buffer: sample {key!r} is already buffered")
        n = int(output.shape[0]) if output.dim() else 1
        if self.budget is not None and self._tokens + n > self.budget:
            raise InvalidInput(
                f"encoder-output buffer: sample {key!r} ({n} tokens) would hold "
                f"{self._tokens + n} tokens, over the plan's defer budget {self.budget}"
            )
        if not output.requires_grad:
            output = output.detach()  # frozen encoder: keep the values, no graph
        self._items[key] = (output, iteration)
        self._tokens += n
        self.peak_tokens = max(self.peak_tokens, self._tokens)
        self._consumer.pop((iteration, key), None)

    def pop(self, key: str, iteration: int | None = None) -> torch.Tensor:
        """The buffered output of ``key``; its encoder backward runs with the consumer's."""
        try:
            output, it = self._items.pop(key)
        except KeyError:
            raise InvalidInput(
                f"encoder-output buffer: sample {key!r} was never encoded on this rank "
                f"(iteration {iteration}); its encoder microbatch must come first"
            ) from None
        if iteration is not None and it != iteration:
            raise InvalidInput(
                f"encoder-output buffer: sample {key!r} encoded in iteration {it} "
                f"but consumed in iteration {iteration}"
            )
        self._tokens -= int(output.shape[0]) if output.dim() else 1
        return output

    def check_drained(self, iteration: int | None = None) -> None:
        """Raise when an iteration ends with samples encoded but never consumed."""
        if iteration is not None:
            self._consumer = {k: v for k, v in self._consumer.items() if k[0] > iteration}
        if self._items:
            left = ", ".join(sorted(self._items)[:5])
            raise InvalidInput(
                f"encoder-output buffer: iteration {iteration} ended with {len(self._items)} "
                f"sample(s) encoded but not consumed ({left})"
            )

    def clear(self) -> None:
        self._items.clear()
        self._consumer.clear()
        self._tokens = 0


def group_iterations(microbatches: Iterable[Microbatch]) -> Iterator[list[Microbatch]]:
    """Group a rank's microbatch stream into iterations (consecutive equal ``(epoch, iteration)``)."""
    current: list[Microbatch] = []
    for mb in microbatches:
        if current and (mb.epoch, mb.iteration) != (current[0].epoch, current[0].iteration):
            yield current
            current = []
        current.append(mb)
    if current:
        yield current
