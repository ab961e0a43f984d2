"""What the service serves, as pure functions of (table size, plan, seed, epoch): no I/O.

An epoch is a seeded permutation of the index cut into global batches of the
plan's size; each global batch is assigned (Entrain's hierarchical assignment,
or the plan's method) to replicas and microbatches. Every position a rank can
ask for is a pure function of these numbers, which is why resume state is a
handful of scalars and a restarted service reproduces exactly the same stream.

A replica's stream is linear: position ``p`` is epoch ``p // S``, iteration
``(p % S) // M``, microbatch ``p % M``, with ``M`` microbatches per iteration and
``S = iterations * M`` positions per epoch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from entrain_data.assignment import assign
from entrain_data.encoder_calls import encoder_calls
from entrain_data.errors import InvalidInput
from entrain_data.plan import ParallelPlan

__all__ = [
    "StreamShape",
    "Slot",
    "epoch_batches",
    "epoch_left_out",
    "Scheduler",
    "data_fingerprint",
    "digest",
]

log = logging.getLogger(__name__)

_CARRYING = frozenset({"wlb_llm"})  # methods that delay samples by their own rule (``carried``)
# delayed samples: the queue is flushed every this many iterations of an epoch (and at its
# end), so a fresh service resuming mid-epoch replays at most this many assignments (it
# replayed the epoch from its start: 0.27 s an iteration at 512 / dp 8, minutes thousands of
# iterations in). max_delay forces a landing every K + 1 iterations anyway.
DELAY_SEGMENT = 16


@dataclass(frozen=True)
class StreamShape:
    """Sizes of one replica's stream: iterations per epoch and microbatches per iteration."""

    iterations: int
    microbatches: int

    @property
    def per_epoch(self) -> int:
        return self.iterations * self.microbatches

    def locate(self, position: int) -> tuple[int, int, int]:
        """(epoch, iteration, microbatch) of a linear stream position."""
        epoch, rest = divmod(position, self.per_epoch)
        iteration, mb = divmod(rest, self.microbatches)
        return epoch, iteration, mb

    def position(self, epoch: int, iteration: int, microbatch: int) -> int:
        """Inverse of :meth:`locate`."""
        return (epoch * self.iterations + iteration) * self.microbatches + microbatch


@dataclass(frozen=True)
class Slot:
    """Table rows of one microbatch of one replica: encoder set and LLM set, in order."""

    encoder_rows: np.ndarray
    llm_rows: np.ndarray
    # group-wide encoder calls of this microbatch (mb.meta["encoder_calls"]; see
    # entrain_data.encoder_calls), when the source says which samples use which encoder
    encoder_calls: dict[str, list[int]] | None = None


def _epoch_split(
    n: int, global_batch: int, min_batch: int, seed: int, epoch: int
) -> tuple[list[np.ndarray], np.ndarray]:
    if global_batch < 1:
        raise InvalidInput(f"global_batch must be >= 1, got {global_batch}")
    perm = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), 0x5EED]).permutation(n)
    batches = [perm[i : i + global_batch] for i in range(0, n, global_batch)]
    left_out = np.zeros(0, dtype=np.int64)
    if batches and len(batches[-1]) < min(global_batch, min_batch):
        left_out = batches.pop().astype(np.int64)
    return [b.astype(np.int64) for b in batches], left_out


def epoch_batches(
    n: int, global_batch: int, min_batch: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """Table rows of every global batch of ``epoch`` (a seeded permutation, cut in order).

    The last, partial batch is kept when it has at least ``min_batch`` samples
    (enough to give every microbatch one); otherwise its samples are left out of
    this epoch (:func:`epoch_left_out` names them; the service records them) - a
    different permutation puts them elsewhere next epoch.
    """
    return _epoch_split(n, global_batch, min_batch, seed, epoch)[0]


def epoch_left_out(n: int, global_batch: int, min_batch: int, seed: int, epoch: int) -> np.ndarray:
    """Table rows that :func:`epoch_batches` leaves out of ``epoch`` (its too-small last batch)."""
    return _epoch_split(n, global_batch, min_batch, seed, epoch)[1]


def frozen_columns(plan: ParallelPlan, encoder_cost: np.ndarray) -> list[bool] | None:
    """Per encoder cost column, whether the plan's model freezes it (None when the source's
    columns are not the plan's cost columns, e.g. a wrapped Dataset's own costs; for one
    summed column, frozen where every encoder is)."""
    frozen = plan.frozen_columns()
    if frozen and np.shape(encoder_cost)[1] == 1 < len(frozen):  # a user's one summed column
        return [all(frozen)]
    return frozen if frozen and len(frozen) == np.shape(encoder_cost)[1] else None


def plan_shares(plan: ParallelPlan, encoder_cost: np.ndarray) -> np.ndarray | None:
    """The plan's stage shares for these cost columns (``ParallelPlan.shares_for``): what
    entrain's proxy prices on; None where the columns are not the plan's cost columns."""
    return plan.shares_for(np.shape(encoder_cost)[1])


class Scheduler:
    """Global batches and their assignment, computed ahead of need and cached per iteration.

    ``encoder_cost`` [N, E], ``llm_cost`` [N] and ``tokens`` [N] are per-sample
    costs over the whole index (from the cost model, computed once). ``assign_fn``
    replaces :func:`~entrain_data.assignment.assign` (same signature; tests slow it down).
    ``pipeline_stages`` is the plan's pp, the depth of entrain's proxy pipeline;
    ``stage_shares`` ([pp, E + 1], ``ParallelPlan.shares_for``) the plan's stages themselves,
    which entrain's proxy then prices on.
    """

    def __init__(
        self,
        encoder_cost: np.ndarray,
        llm_cost: np.ndarray,
        tokens: np.ndarray,
        *,
        dp: int,
        microbatches: int,
        global_batch: int,
        max_tokens: int | None,
        defer_budget: int | None,
        method: str,
        seed: int,
        cache: int = 8,
        assign_fn: Callable[..., Any] | None = None,
        max_delay: int = 0,
        max_encoder_patches: int | None = None,
        encoder_stats: tuple[np.ndarray, dict[str, np.ndarray]] | None = None,
        frozen_encoders: list[bool] | None = None,
        pipeline_stages: int | None = None,
        stage_shares: np.ndarray | None = None,
        delay_segment: int = DELAY_SEGMENT,
    ) -> None:
        self.encoder_cost = np.asarray(encoder_cost)
        self.llm_cost = np.asarray(llm_cost)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.dp, self.microbatches = int(dp), int(microbatches)
        self.global_batch = int(global_batch)
        self.max_tokens, self.defer_budget = max_tokens, defer_budget
        self.method, self.seed = method, int(seed)
        self.max_delay = int(max_delay)
        self.delay_segment = int(delay_segment)
        if self.delay_segment < 1:
            raise InvalidInput(f"delay_segment must be >= 1, got {delay_segment}")
        # the plan's memory cap on an encoder set's patches; per sample its patches (per cost
        # column) and which encoders it uses (the source's encoder_stats), for the cap and the
        # group-wide calls
        self.encoder_patches, self.encoder_uses = encoder_stats or (None, None)
        self.max_encoder_patches = max_encoder_patches if encoder_stats else None
        self.assign_fn = assign_fn or assign
        # per encoder column: forward only (entrain's pipeline proxy places no backward)
        self.frozen_encoders = list(frozen_encoders or [])
        self.pipeline_stages = pipeline_stages  # the plan's pp: the depth entrain's proxy prices
        self.stage_shares = stage_shares  # the plan's stages: what entrain's proxy prices on
        n = len(self.llm_cost)
        min_batch = self.dp * self.microbatches
        probe = epoch_batches(n, self.global_batch, min_batch, self.seed, 0)
        if not probe:
            raise InvalidInput(
                f"the index has {n} samples, too few for one global batch of "
                f"dp={self.dp} x microbatches={self.microbatches}"
            )
        self.shape = StreamShape(len(probe), self.microbatches)
        self._batches: dict[int, list[np.ndarray]] = {0: probe}
        self._slots: dict[tuple[int, int], list[list[Slot]]] = {}
        self._cache = cache
        self.latencies: list[float] = []
        # max_delay > 0: the samples waiting before each assigned iteration, (epoch, iteration)
        # -> carry, kept for the last two epochs (a few rows each): a rank asking again for an
        # iteration dropped from the cache costs one assignment, not a replay of its epoch
        self._carry: dict[tuple[int, int], _Carry] = {}
        self._last_carried = np.zeros(0, dtype=np.int64)

    @classmethod
    def for_plan(
        cls,
        plan: ParallelPlan,
        costs: tuple[np.ndarray, np.ndarray, np.ndarray],
        *,
        seed: int,
        source: Any = None,
        assign_fn: Callable[..., Any] | None = None,
    ) -> Scheduler:
        """The schedule a service serves for ``plan``: its shape, caps, method, delay and
        stages; ``costs`` is the source's ``(encoder [N, E], llm [N], tokens [N])`` and
        ``source`` (optional) adds its per-sample patches for the encoder-set cap."""
        from .sample_source import encoder_stats

        enc, llm, tokens = costs
        return cls(
            enc,
            llm,
            tokens,
            dp=plan.dp,
            microbatches=plan.microbatches,
            global_batch=plan.global_batch,
            max_tokens=plan.max_tokens,
            defer_budget=plan.defer_budget,
            method=plan.method,
            seed=seed,
            assign_fn=assign_fn,
            max_delay=plan.max_delay,
            max_encoder_patches=plan.max_encoder_patches or None,
            encoder_stats=encoder_stats(source) if source is not None else None,
            frozen_encoders=frozen_columns(plan, enc),
            pipeline_stages=plan.pp,
            stage_shares=plan_shares(plan, enc),
        )

    def check_fits(self, keys: list[str] | None) -> None:
        """Refuse at start the samples no microbatch of the plan can hold (a plan made on
        another index): serving would stop at the first global batch holding one, naming it
        by its place in that batch, possibly hours in."""
        cap = self.max_tokens
        over = [] if cap is None else [
            (i, f"{self.tokens[i]} LLM tokens > max_tokens={cap}")
            for i in np.flatnonzero(self.tokens > cap)
        ]  # fmt: skip
        if self.max_encoder_patches and self.encoder_patches is not None:
            pt = np.asarray(self.encoder_patches).reshape(len(self.tokens), -1)
            big = np.argwhere(pt > self.max_encoder_patches)
            cap = self.max_encoder_patches
            over += [(i, f"{pt[i, k]} patches in encoder column {k} > max_encoder_patches={cap}")
                     for i, k in big]  # fmt: skip
        if over:
            named = "; ".join(f"{keys[i] if keys else f'row {i}'}: {why}" for i, why in over[:5])
            more = f" and {len(over) - 5} more" if len(over) > 5 else ""
            raise InvalidInput(
                f"{len(over)} sample(s) fit no microbatch of this plan (was it made for another "
                f"index? plan again on this one): {named}{more}"
            )

    def left_out(self, epoch: int) -> np.ndarray:
        """Rows of ``epoch`` that no global batch holds (see :func:`epoch_left_out`)."""
        n = len(self.llm_cost)
        return epoch_left_out(n, self.global_batch, self.dp * self.microbatches, self.seed, epoch)

    def batches(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._batches:
            if len(self._batches) > 2:
                self._batches.pop(min(self._batches))
            self._batches[epoch] = epoch_batches(
                len(self.llm_cost),
                self.global_batch,
                self.dp * self.microbatches,
                self.seed,
                epoch,
            )
        return self._batches[epoch]

    def slots(self, epoch: int, iteration: int) -> list[list[Slot]]:
        """[replica][microbatch] -> :class:`Slot` for one iteration (assigned on first use)."""
        key = (epoch, iteration)
        if key not in self._slots:
            if self.max_delay > 0 or self.method in _CARRYING:
                self._assign_delayed(epoch, iteration)
            else:
                rows = self.batches(epoch)[iteration]
                self._slots[key] = self._assign(rows, None, epoch, iteration)
            while len(self._slots) > self._cache:
                self._slots.pop(next(iter(self._slots)))
        return self._slots[key]

    def _assign(
        self, rows: np.ndarray, ages: np.ndarray | None, epoch: int, iteration: int
    ) -> list[list[Slot]]:
        """Assign one global batch (``rows``); with ``ages``, returns its carried rows too."""
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if self.max_encoder_patches:
            extra.update(
                encoder_patches=self.encoder_patches[rows],
                max_encoder_patches=self.max_encoder_patches,
            )
        if any(self.frozen_encoders):
            extra["frozen_encoders"] = self.frozen_encoders
        if self.pipeline_stages is not None:
            extra["pipeline_stages"] = self.pipeline_stages
        if self.stage_shares is not None:
            extra["stage_shares"] = self.stage_shares
        if ages is not None:  # nothing leaves its segment (:data:`DELAY_SEGMENT`) or epoch
            extra["flush"] = self._flushes(iteration)
            if self.max_delay > 0:
                extra.update(max_delay=self.max_delay, ages=ages)
        a = self.assign_fn(
            self.encoder_cost[rows],
            self.llm_cost[rows],
            self.tokens[rows],
            dp=self.dp,
            microbatches=self.microbatches,
            max_tokens=self.max_tokens,
            defer_budget=self.defer_budget,
            method=self.method,
            seed=self.seed,
            iteration=epoch * self.shape.iterations + iteration,
            **extra,
        )
        self.latencies.append(time.perf_counter() - t0)
        if len(a.carried) and ages is None:
            raise InvalidInput(
                f"assignment method {self.method!r} carries samples across iterations; "
                "the loader serves only methods that keep every sample in its iteration "
                "(entrain's opt-in bounded delay is plan.max_delay)"
            )
        self._last_carried = np.asarray(a.carried, dtype=np.int64)
        if len(self._last_carried) and extra.get("flush"):
            raise InvalidInput(
                f"assignment method {self.method!r} carried {len(a.carried)} sample(s) past "
                f"iteration {iteration} of epoch {epoch} although asked to flush"
            )
        calls: list[Any] = [None] * a.microbatches
        if self.encoder_uses:
            calls = encoder_calls(a, {k: v[rows] for k, v in self.encoder_uses.items()})
        return [
            [
                Slot(rows[a.encoder_sets[r][j]], rows[a.llm_sets[r][j]], calls[j])
                for j in range(a.microbatches)
            ]
            for r in range(a.dp)
        ]

    def _flushes(self, iteration: int) -> bool:
        """Whether delayed samples all land in this iteration: the last of its segment or of
        its epoch."""
        last = iteration == self.shape.iterations - 1
        return last or iteration % self.delay_segment == self.delay_segment - 1

    def _assign_delayed(self, epoch: int, iteration: int) -> None:
        """Delayed samples (``plan.max_delay``, or ``wlb_llm``'s outlier queue): iteration i's
        batch is its own rows plus the samples iteration i-1 carried, so iterations are assigned
        in order from the start of their segment, where nothing waits (every
        :data:`DELAY_SEGMENT` iterations of an epoch: a mid-epoch resume replays at most that
        many; a lagging rank asking for one dropped from the cache costs only its own
        assignment, from the carry kept for it). The last iteration of a segment and of the
        epoch flushes, so every sample is served once per epoch and the stream stays a pure
        function of the seed: resume stays exact."""
        carry = self._carry.get((epoch, iteration))
        if carry is None:
            start = iteration - iteration % self.delay_segment
            known = [i for e, i in self._carry if e == epoch and start <= i <= iteration]
            empty = np.zeros(0, dtype=np.int64)
            carry = self._carry[(epoch, max(known))] if known else _Carry(start, empty, empty)
        batches = self.batches(epoch)
        while carry.next <= iteration:
            i = carry.next
            self._carry[(epoch, i)] = carry
            rows = np.concatenate([carry.rows, batches[i]])
            ages = np.concatenate([carry.ages, np.zeros(len(batches[i]), dtype=np.int64)])
            self._slots[(epoch, i)] = self._assign(rows, ages, epoch, i)
            kept = self._last_carried
            carry = _Carry(i + 1, rows[kept], ages[kept] + 1)
        self._carry[(epoch, carry.next)] = carry
        for old in [k for k in self._carry if k[0] < epoch - 1]:
            del self._carry[old]


@dataclass(frozen=True)
class _Carry:
    """Samples waiting after iteration ``next - 1`` of an epoch, with the iterations waited."""

    next: int
    rows: np.ndarray
    ages: np.ndarray


def digest(parts: list[Any]) -> str:
    """A short, stable hash of JSON-serialisable parts."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def data_fingerprint(
    enc: Any, llm: Any, tokens: Any, keys: list[str] | None, *, seed: int, global_batch: int
) -> str:
    """What makes two services cut the same global batches: seed, batch size, the samples.

    The samples are hashed by content (their keys and the costs the schedule balances),
    so two nodes with different copies of an index, or another seed, disagree. The encoder
    costs count summed over their columns: a re-plan that balances the encoders in other
    columns (``ParallelPlan.cost_columns``) cuts the same global batches, and the plan's own
    fingerprint tells the service to resume it at the start of the iteration. (Exact for two
    encoders; with three, float addition in another order can differ in the last bit, and the
    state is then refused as another index.)
    """
    h = hashlib.sha256()
    enc = np.asarray(enc)
    enc = enc.sum(axis=1) if enc.ndim == 2 and enc.shape[1] > 1 else enc  # [N, 0]: no bytes
    for arr in (enc, llm, tokens):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update("\n".join(keys or []).encode())
    return digest([h.hexdigest(), int(seed), int(global_batch)])
