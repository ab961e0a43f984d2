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
import numbers
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
    "check_microbatch",
    "iteration_microbatches",
    "collective_device",
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


def _where(mb: Microbatch, who: str) -> str:
    return f"{who}: iteration {mb.iteration} microbatch {mb.microbatch} (replica {mb.replica})"


def check_microbatch(mb: object, who: str, require: Sequence[str] = ()) -> None:
    """Refuse a microbatch the adapters would misread, naming it and the field.

    The LLM part (``input_ids``, ``labels``, ``cu_seqlens``, and ``require``)
    may be absent only when the microbatch has no LLM set; when present, the
    token tensors must be 1-D and of one length, and ``cu_seqlens`` must run
    from 0 to that length, one boundary per LLM-set sample. Without this a
    missing ``labels`` counts as no loss tokens and a bad ``cu_seqlens`` fails
    deep inside a loss or attention kernel.
    """
    if not isinstance(mb, Microbatch):
        raise InvalidInput(f"{who}: got a {type(mb).__name__}, not a Microbatch")
    where = _where(mb, who)
    names = ("input_ids", "labels", "cu_seqlens", *require)
    if not mb.llm_keys and not any(n in mb for n in names):
        return  # no LLM part at all: an encoder-only (or empty) microbatch
    for name in names:
        if name not in mb:
            raise InvalidInput(f"{where}: field {name!r} is missing")
    tokens = mb["input_ids"].shape
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
        if name in mb and mb[name].dim() != 1:
            raise InvalidInput(
                f"{where}: field {name!r} has shape {tuple(mb[name].shape)}, not 1-D"
            )
    for name in ("labels", "position_ids"):
        if name in mb and mb[name].shape != tokens:
            raise InvalidInput(
                f"{where}: field {name!r} has {mb[name].numel()} entries but input_ids has "
                f"{tokens[0]}"
            )
    if mb["labels"].dtype.is_floating_point:
        raise InvalidInput(f"{where}: field 'labels' is {mb['labels'].dtype}, not an integer type")
    cu = mb["cu_seqlens"].tolist()
    if len(cu) != len(mb.llm_keys) + 1 or cu[0] != 0 or cu[-1] != tokens[0]:
        raise InvalidInput(
            f"{where}: field 'cu_seqlens' {cu[:8]}{'...' if len(cu) > 8 else ''} must run from "
            f"0 to {tokens[0]} (input_ids) with {len(mb.llm_keys) + 1} entries (llm_keys + 1)"
        )
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise InvalidInput(f"{where}: field 'cu_seqlens' decreases: {cu[:8]}")


def iteration_microbatches(
    microbatches: Iterable[Microbatch], who: str, require: Sequence[str] = ()
) -> list[Microbatch]:
    """``microbatches`` as a checked list of one iteration's microbatches.

    Entry points read their microbatches more than once (loss count, encoder
    calls, buffer announcements, the steps), so a generator is materialised
    here rather than silently consumed by the first read; every rank of a DP
    group must then see a non-empty list, or the collectives that follow hang.
    """
    if isinstance(microbatches, (str, bytes, Microbatch)) or not isinstance(microbatches, Iterable):
        raise InvalidInput(
            f"{who}: expected this iteration's microbatches (a list), got "
            f"{type(microbatches).__name__}"
        )
    out = list(microbatches)
    if not out:
        raise InvalidInput(f"{who}: no microbatches given for this iteration")
    for mb in out:
        check_microbatch(mb, who, require)
    first = out[0]
    for mb in out[1:]:
        if (mb.epoch, mb.iteration) != (first.epoch, first.iteration):
            raise InvalidInput(
                f"{who}: microbatch {mb.microbatch} is of (epoch, iteration) "
                f"{(mb.epoch, mb.iteration)}, microbatch {first.microbatch} of "
                f"{(first.epoch, first.iteration)}: pass one iteration at a time "
                "(group_iterations)"
            )
    return out


def collective_device(
    group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
) -> torch.device:
    """Where a tensor entering a collective over ``group`` must live: ``device`` when given,
    else the current CUDA device for an NCCL-only group (NCCL reduces only CUDA tensors),
    else the CPU."""
    if device is not None:
        return torch.device(device)
    on = dist.is_available() and dist.is_initialized()
    if on and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def loss_units(mb: Microbatch, mode: str = "token") -> int:
    """This microbatch's share of the loss denominator (loss tokens, or samples with a loss token)."""
    _check_mode(mode)
    if "labels" not in mb:
        if mb.llm_keys:
            raise InvalidInput(f"{_where(mb, 'loss count')}: field 'labels' is missing")
        return 0
    valid = mb["labels"] != -100
    if mode == "token":
        return int(valid.sum())
    if "cu_seqlens" not in mb:
        raise InvalidInput(f"{_where(mb, 'loss count')}: field 'cu_seqlens' is missing")
    lengths = torch.diff(mb["cu_seqlens"].long())
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths.cpu())
    return int(torch.bincount(owner[valid.cpu()], minlength=len(lengths)).gt(0).sum())


def global_loss_count(
    microbatches: Sequence[Microbatch],
    mode: str = "token",
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> int:
    """The loss denominator of the whole global batch: this replica's count summed over ``group``.

    ``microbatches`` are this replica's microbatches of one iteration; ``group``
    is the data-parallel group (None: the default group when initialised; no
    communication when not). Pipeline and tensor-parallel ranks of a replica
    see the same microbatches, so they must not be in ``group``. ``device``: where the count
    is reduced (None: :func:`collective_device`).
    """
    local = sum(loss_units(mb, mode) for mb in microbatches)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor([local], dtype=torch.int64, device=collective_device(group, device))
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
        if budget is not None and (not isinstance(budget, numbers.Integral) or budget < 0):
            raise InvalidInput(f"encoder-output buffer: budget must be an int >= 0, got {budget!r}")
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
ENCODER_OWNERS = {"vision": ("image_sample", "video_sample"), "audio": ("audio_sample",)}
"""Per encoder name, the ``batch.py`` tensors naming each item's owner in ``encoder_keys``: the
vision encoder takes still images and video clips (the service counts both as its uses)."""


def local_call_groups(microbatches: Sequence[Microbatch], names: Sequence[str]) -> torch.Tensor:
    """This replica's encoder call groups of one iteration: ``[M, M, E]`` uint8, ``[j, c, e]``
    set when microbatch j encodes, for consumer c, samples with items for encoder ``names[e]``."""
    m = len(microbatches)
    consumer = {key: c for c, mb in enumerate(microbatches) for key in mb.llm_keys}
    groups = torch.zeros(m, m, len(names), dtype=torch.uint8)
    for j, mb in enumerate(microbatches):
        for e, name in enumerate(names):
            owners = ENCODER_OWNERS.get(name)
            if owners is None:
                raise InvalidInput(f"encoder calls: unknown encoder {name!r}")
            items = {o for owner in owners if owner in mb for o in mb[owner].tolist()}
            for o in items:
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
    device: torch.device | str | None = None,
) -> list[Microbatch]:
    """The microbatches, each with ``meta[ENCODER_CALLS_KEY]`` set: the loader service's value
    when every microbatch has one, else the union over ``group`` (the data-parallel group) of
    every replica's call groups, from one max all-reduce of ``M * M * E`` bytes."""
    if all(ENCODER_CALLS_KEY in mb.meta for mb in microbatches):
        return list(microbatches)
    groups = local_call_groups(microbatches, names)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = groups.to(
            device=collective_device(group, device), dtype=torch.int32
        )  # gloo has no uint8 MAX on every build
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
