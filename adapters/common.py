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

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch import Microbatch
from ..encoder_calls import ENCODER_CALLS_KEY, calls_from_groups
from ..errors import InvalidInput
from ..plan import ParallelPlan

__all__ = [
    "LOSS_MODES",
    "loss_sums",
    "loss_units",
    "global_loss_count",
    "loss_scale",
    "EncoderOutputBuffer",
    "group_iterations",
    "require_world",
    "local_call_groups",
    "resolve_encoder_calls",
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


def require_world(plan: ParallelPlan, who: str) -> None:
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
        self._pads: dict[tuple[int, int], list[torch.Tensor]] = {}

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

    def put_pad(self, consumer: int, output: torch.Tensor, iteration: int = 0) -> None:
        """Hold a pad call's output (see :mod:`entrain_data.encoder_calls`) until microbatch
        ``consumer`` adds it to its loss times zero, so the pad's backward runs with that
        microbatch's, as a real deferred group's would. Not counted against the budget."""
        self._pads.setdefault((iteration, consumer), []).append(output)

    def pop_pads(self, consumer: int, iteration: int = 0) -> list[torch.Tensor]:
        """The pad outputs bound for microbatch ``consumer`` (empty when none)."""
        return self._pads.pop((iteration, consumer), [])

    def check_drained(self, iteration: int | None = None) -> None:
        """Raise when an iteration ends with samples encoded but never consumed."""
        if iteration is not None:
            self._consumer = {k: v for k, v in self._consumer.items() if k[0] > iteration}
        if self._pads:
            left_pads = sorted(self._pads)
            self._pads.clear()
            raise InvalidInput(
                f"encoder-output buffer: iteration {iteration} ended with pad calls bound for "
                f"(iteration, microbatch) {left_pads} never consumed"
            )
        if self._items:
            left = ", ".join(sorted(self._items)[:5])
            raise InvalidInput(
                f"encoder-output buffer: iteration {iteration} ended with {len(self._items)} "
                f"sample(s) encoded but not consumed ({left})"
            )

    def clear(self) -> None:
        self._items.clear()
        self._pads.clear()
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


# -------------------------------------------------- group-wide encoder calls (sharding)
ENCODER_OWNERS = {"vision": "image_sample", "audio": "audio_sample"}
"""Per encoder name, the ``batch.py`` tensor naming each item's owner in ``encoder_keys``."""


def local_call_groups(microbatches: Sequence[Microbatch], names: Sequence[str]) -> torch.Tensor:
    """This replica's encoder call groups of one iteration: ``[M, M, E]`` uint8, ``[j, c, e]``
    set when microbatch j encodes, for consumer c, samples with items for encoder ``names[e]``."""
    m = len(microbatches)
    consumer = {key: c for c, mb in enumerate(microbatches) for key in mb.llm_keys}
    groups = torch.zeros(m, m, len(names), dtype=torch.uint8)
    for j, mb in enumerate(microbatches):
        for e, name in enumerate(names):
            owner = ENCODER_OWNERS.get(name)
            if owner is None:
                raise InvalidInput(f"encoder calls: unknown encoder {name!r}")
            if owner not in mb:
                continue
            for o in set(mb[owner].tolist()):
                key = mb.encoder_keys[o]
                c = consumer.get(key)
                if c is None or c < j:
                    raise InvalidInput(
                        f"sample {key!r} encoded in microbatch {j} of iteration {mb.iteration} "
                        "is consumed by no later microbatch of it"
                    )
                groups[j, c, e] = 1
    return groups


def resolve_encoder_calls(
    microbatches: Sequence[Microbatch],
    names: Sequence[str] = ("vision", "audio"),
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[Microbatch]:
    """The microbatches, each with ``meta[ENCODER_CALLS_KEY]`` set: the loader service's value
    when every microbatch has one, else the union over ``group`` (the data-parallel group) of
    every replica's call groups, from one max all-reduce of ``M * M * E`` bytes."""
    if all(ENCODER_CALLS_KEY in mb.meta for mb in microbatches):
        return list(microbatches)
    groups = local_call_groups(microbatches, names)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = groups.to(device=device, dtype=torch.int32)  # gloo has no uint8 MAX on every build
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        groups = t.cpu()
    calls = calls_from_groups(groups.numpy().astype(bool), list(names))
    out = []
    for j, mb in enumerate(microbatches):
        meta = dict(mb.meta)
        meta[ENCODER_CALLS_KEY] = calls[j]
        out.append(
            Microbatch(
                mb.epoch,
                mb.iteration,
                mb.microbatch,
                mb.replica,
                mb.encoder_keys,
                mb.llm_keys,
                mb.tensors,
                meta,
            )  # fmt: skip
        )
    return out
