"""The static parallel plan: frozen, validated value types serialised to JSON with a schema version.

A plan is applied once at start-up and never re-sharded: every part of the
system (the loader service, the adapters) reads the same file.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, Field, asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .cost_columns import column_shares, group_columns, share_columns
from .errors import InvalidInput, PlanError
from .plan_checks import check_plan_fields, check_plan_model, check_segment, plan_kwargs
from .presets import ModelSpec

__all__ = [
    "PLAN_SCHEMA_VERSION",
    "Cluster",
    "StageSegment",
    "StagePlan",
    "RankCoords",
    "ParallelPlan",
    "SHARDING",
    "encoder_groups",
]

PLAN_SCHEMA_VERSION = 1

SHARDING = ("none", "optimizer", "gradients", "full")
"""What the data-parallel group shards (``ParallelPlan.sharding``): nothing (DDP), optimizer
state and master weights (ZeRO-1, Megatron's distributed optimizer), also gradients (ZeRO-2),
also the weights (ZeRO-3, FSDP with every block wrapped)."""


@dataclass(frozen=True)
class Cluster:
    """The GPUs a job runs on. Bandwidths are per GPU, in GB/s (NVLink inside a node, IB across)."""

    world_size: int
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0

    def __post_init__(self) -> None:
        for f in ("world_size", "gpus_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise InvalidInput(f"cluster: {f} must be a positive integer, got {v!r}")
        for f in ("gpu_memory_gb", "intra_node_gbps", "inter_node_gbps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise InvalidInput(f"cluster: {f} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class StageSegment:
    """Layers ``[layer_start, layer_end)`` of one module held by a pipeline stage.

    ``first``/``last``: the stage also holds the module's embedding / head.
    ``encoder_index`` is the encoder's column (None for the LLM).
    """

    module: str
    encoder_index: int | None
    layer_start: int
    layer_end: int
    first: bool
    last: bool

    def __post_init__(self) -> None:
        check_segment(f"stage segment {self.module!r}", self)

    @property
    def kind(self) -> str:
        return "llm" if self.encoder_index is None else "encoder"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the module segments it holds and its expected load per iteration."""

    index: int
    segments: tuple[StageSegment, ...]
    expected_load: float = 0.0
    recompute: bool = False  # full activation recomputation on this stage

    def __post_init__(self) -> None:
        if not self.segments:
            raise InvalidInput(f"stage {self.index} holds no layers")
        object.__setattr__(self, "segments", tuple(self.segments))

    @property
    def module(self) -> str:
        """The modules of this stage, ``+``-joined (``llm``, ``qwen2.5-vl-vision+llm`` ...)."""
        return "+".join(dict.fromkeys(s.module for s in self.segments))

    @property
    def kind(self) -> str:
        kinds = {s.kind for s in self.segments}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    # The contract's single-module view (README: StagePlan). A stage that holds
    # several modules (encoders riding on the first LLM stage) reports its first
    # segment here; ``segments`` lists them all.
    @property
    def encoder_index(self) -> int | None:
        return self.segments[0].encoder_index

    @property
    def layer_start(self) -> int:
        return self.segments[0].layer_start

    @property
    def layer_end(self) -> int:
        return self.segments[0].layer_end

    @property
    def first(self) -> bool:
        return self.segments[0].first

    @property
    def last(self) -> bool:
        return self.segments[0].last

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form of the stage (its segments and expected load)."""
        return {
            "index": self.index,
            "module": self.module,
            "kind": self.kind,
            "layers": {s.module: [s.layer_start, s.layer_end] for s in self.segments},
            "segments": [asdict(s) for s in self.segments],
            "expected_load": self.expected_load,
            "recompute": self.recompute,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StagePlan:
        """The stage of :meth:`to_dict` (fields typed and named when bad)."""
        from .plan_checks import plan_kwargs

        try:
            return plan_kwargs({"stages": [d]}, set(), StageSegment, cls)["stages"][0]
        except InvalidInput as exc:
            raise type(exc)(f"plan: {exc}") from exc


def _required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


class RankCoords(NamedTuple):
    """Where a global rank sits: its DP replica, pipeline stage and tensor-parallel rank.

    A named tuple, so ``replica, stage, tp_rank = plan.rank_coords(r)`` works too.
    """

    replica: int
    stage: int
    tp_rank: int


def encoder_groups(stages: tuple[StagePlan, ...]) -> list[list[int]]:
    """Encoder columns that share a pipeline stage of ``stages``, grouped (ascending, disjoint).

    Encoders on the same stage (all of them when ``pp == 1``) run on the same GPU one after
    the other. The loader service balances one cost column per :meth:`ParallelPlan.cost_columns`
    group (encoders laid out alike over the stages) and tells ``assign`` each column's share of
    every stage (``stage_shares``), which prices that sum sample by sample; earlier plans
    recorded their shares per group of this function.
    """
    n_enc = max(
        [s.encoder_index + 1 for st in stages for s in st.segments if s.encoder_index is not None],
        default=0,
    )
    parent = list(range(n_enc))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for st in stages:
        idx = sorted({s.encoder_index for s in st.segments if s.encoder_index is not None})
        for j in idx[1:]:
            parent[root(j)] = root(idx[0])
    groups: dict[int, list[int]] = {}
    for i in range(n_enc):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


@dataclass(frozen=True)
class ParallelPlan:
    """The static plan (see DESIGN.md, "Static plan"): layout, microbatching, expectations."""

    world_size: int
    gpus_per_node: int
    dp: int
    tp: int
    pp: int
    stages: tuple[StagePlan, ...]
    microbatches: int
    global_batch: int
    max_tokens: int
    defer_budget: int
    method: str = "entrain"
    # encoder patches per encoder set (each encoder; the memory model's figure), 0: no cap
    max_encoder_patches: int = 0
    max_delay: int = 0  # iterations a heavy sample may wait (assign(..., max_delay)); 0: none
    schedule: str = "1f1b"
    expected_iteration_time: float = 0.0
    ideal_iteration_time: float = 0.0
    oracle_gap: float = 0.0
    worst_static_gap: float = 0.0
    memory_gb: tuple[float, ...] = ()
    recompute: bool = False  # any stage recomputes (see StagePlan.recompute)
    sharding: str = "optimizer"  # one of SHARDING
    model: dict = field(default_factory=dict)
    calibration: dict | None = None
    # per stage, each encoder's share of its work, then the LLM's (simulator.stage_shares on
    # the profiled batches): the layout entrain's assignment prices; (): not recorded
    stage_shares: tuple[tuple[float, ...], ...] = ()
    search: dict = field(default_factory=dict)
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        for f in ("stages", "memory_gb"):
            v = getattr(self, f)
            if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
                raise InvalidInput(f"plan: field {f!r} must be a list, got {v!r}")
            object.__setattr__(self, f, tuple(v))
        if not all(isinstance(st, StagePlan) for st in self.stages):
            raise InvalidInput("plan: field 'stages' must hold StagePlan entries")
        check_plan_fields(self)
        if self.dp * self.tp * self.pp != self.world_size:
            raise PlanError(
                f"plan: dp*tp*pp = {self.dp}*{self.tp}*{self.pp} != world_size {self.world_size}"
            )
        if len(self.stages) != self.pp:
            raise InvalidInput(f"plan: {len(self.stages)} stages listed for pp={self.pp}")
        if self.global_batch < self.dp * self.microbatches:
            raise PlanError(
                f"plan: global_batch {self.global_batch} < dp*microbatches = {self.dp * self.microbatches}"
            )
        if self.sharding not in SHARDING:
            raise InvalidInput(
                f"plan: field 'sharding' is {self.sharding!r}, choose one of {', '.join(SHARDING)}"
            )
        if self.schema_version > PLAN_SCHEMA_VERSION:
            raise InvalidInput(
                f"plan: schema version {self.schema_version} is newer than this package's ({PLAN_SCHEMA_VERSION})"
            )
        check_plan_model(self)
        self._check_stage_shares()

    def _check_stage_shares(self) -> None:
        """``stage_shares`` as tuples of floats, [pp][encoders + 1], each column summing to 1
        (:func:`entrain_data.assignment.common.check_stage_shares`'s rules). Plans written
        before the per-encoder record hold one column per :meth:`encoder_groups` group; they
        still load (their fingerprint unchanged) and are served as before, a column per
        group."""
        from .assignment.common import check_stage_shares

        try:
            shape = np.shape(self.stage_shares)
        except ValueError:  # ragged rows: check_stage_shares names them
            shape = (-1,)
        if self.stage_shares is None or 0 in shape:
            object.__setattr__(self, "stage_shares", ())
            return
        groups = self.encoder_groups()
        n_enc, width = sum(len(g) for g in groups), shape[-1] if shape else -1
        try:
            e = len(groups) if width == len(groups) + 1 else n_enc  # a group-wise plan
            sh = check_stage_shares(self.stage_shares, e, self.pp)
        except InvalidInput as exc:
            raise InvalidInput(f"plan: field 'stage_shares': {exc}") from exc
        object.__setattr__(self, "stage_shares", tuple(tuple(map(float, r)) for r in sh))

    def cost_columns(self) -> list[list[int]]:
        """The encoders of each cost column the loader service balances
        (:func:`~entrain_data.cost_columns.share_columns` of the recorded shares: encoders laid
        out alike and frozen alike are summed); :meth:`encoder_groups` for a plan that recorded
        none, or recorded them per group."""
        sh = np.asarray(self.stage_shares, dtype=np.float64)
        groups = self.encoder_groups()
        n_enc = sum(len(g) for g in groups)
        if sh.ndim != 2 or sh.shape[1] != n_enc + 1 or sh.shape[1] == len(groups) + 1:
            return groups  # none recorded, or per group (then each group is one column)
        frozen = [e.frozen for e in self.model_spec().encoders] if self.model else None
        return share_columns(sh, frozen)

    def column_costs(self, encoder_cost: np.ndarray) -> np.ndarray:
        """[N, E] per-encoder sample costs (or patches) -> [N, G], one per :meth:`cost_columns`."""
        return group_columns(encoder_cost, self.cost_columns())

    def shares_for(self, encoder_columns: int) -> np.ndarray | None:
        """The recorded ``stage_shares`` per :meth:`cost_columns` column ([pp, G + 1]) where a
        caller's cost columns are as many (a source priced by the plan's model, or a user's
        one encoder cost beside a one-column plan), else None (none recorded, or other
        columns): what ``assign(stage_shares=)`` takes."""
        sh = np.asarray(self.stage_shares, dtype=np.float64)
        cols = self.cost_columns()
        if sh.ndim != 2 or encoder_columns != len(cols):
            return None
        if sh.shape[1] == len(cols) + 1:  # recorded per column already
            return sh
        return column_shares(sh, cols) if sh.shape[1] == sum(map(len, cols)) + 1 else None

    def frozen_columns(self) -> list[bool]:
        """Per :meth:`cost_columns` column, whether the plan's model freezes its encoders
        (forward only); [] without a saved model."""
        if not self.model:
            return []
        encoders = self.model_spec().encoders
        return [all(encoders[i].frozen for i in g) for g in self.cost_columns()]

    def with_stage_shares(self, costs: Any, rows: np.ndarray | None = None) -> ParallelPlan:
        """This plan with ``stage_shares`` measured on ``costs`` (a
        :class:`~entrain_data.cost_model.SampleCosts` of the plan's model; ``rows``: the
        profiled samples, all where None), one column per encoder."""
        from .simulator import stage_shares

        sh = stage_shares(costs, self.stages, None, rows)
        return replace(self, stage_shares=sh)  # checked and made tuples in __post_init__

    # -------------------------------------------------------------- queries
    def model_spec(self) -> ModelSpec:
        """The model the plan was made for (encoders, LLM) as a :class:`ModelSpec`."""
        if not self.model:
            raise InvalidInput("plan: no model spec saved in this plan")
        return ModelSpec.from_dict(self.model)

    def rank_coords(self, rank: int) -> RankCoords:
        """Megatron's rank order: tensor-parallel fastest, then data-parallel, then pipeline."""
        if not 0 <= rank < self.world_size:
            raise InvalidInput(f"rank {rank} outside 0..{self.world_size - 1}")
        tp_rank = rank % self.tp
        replica = (rank // self.tp) % self.dp
        stage = rank // (self.tp * self.dp)
        return RankCoords(replica, stage, tp_rank)

    def ranks_of_replica(self, replica: int) -> list[int]:
        """Every global rank that serves DP replica ``replica`` (all stages and TP ranks)."""
        if not 0 <= replica < self.dp:
            raise InvalidInput(f"replica {replica} outside 0..{self.dp - 1}")
        return [
            (s * self.dp + replica) * self.tp + t for s in range(self.pp) for t in range(self.tp)
        ]

    def encoder_groups(self) -> list[list[int]]:
        """Encoder columns that share a pipeline stage, grouped (:func:`encoder_groups`)."""
        return encoder_groups(self.stages)

    def llm_layer_ranges(
        self, who: str, *, encoder_stages: bool = False, hint: str = ""
    ) -> list[tuple[int, int]]:
        """LLM layers ``[start, end)`` of every stage that holds LLM layers, checked once for
        every adapter: the ranges are contiguous from layer 0, encoder layers ride only on
        the first LLM stage (where the embedding consumes their outputs), and a stage without
        LLM layers is refused unless ``encoder_stages`` allows leading encoder-only stages
        (Megatron's multi-module layout). ``who`` and ``hint`` go into the message."""
        hint = f"; {hint}" if hint else ""
        n_enc = 0
        while encoder_stages and n_enc < len(self.stages) and self.stages[n_enc].kind == "encoder":
            n_enc += 1
        ranges = []
        for i, st in enumerate(self.stages):
            llm = [s for s in st.segments if s.encoder_index is None]
            if i < n_enc:
                continue
            if not llm:
                where = (
                    f"is encoder-only but follows LLM stage {n_enc}"
                    if encoder_stages
                    else "holds no LLM layers"
                )
                raise PlanError(f"{who}: plan.stages[{i}] {where}{hint}")
            riding = [s.module for s in st.segments if s.encoder_index is not None]
            if i > n_enc and riding:
                raise PlanError(
                    f"{who}: plan.stages[{i}].segments hold encoder layers {riding} on LLM "
                    f"stage {i}; only the first LLM stage ({n_enc}) may, where the embedding "
                    "consumes their outputs"
                )
            ranges.append((llm[0].layer_start, llm[-1].layer_end))
            if any(a.layer_end != b.layer_start for a, b in zip(llm, llm[1:])):
                raise PlanError(f"{who}: plan.stages[{i}] LLM segments are not contiguous")
        if not ranges:
            raise PlanError(f"{who}: no stage of the plan holds LLM layers{hint}")
        if ranges[0][0] != 0:
            raise PlanError(f"{who}: the first LLM stage starts at layer {ranges[0][0]}, not 0")
        for i, ((_, end), (start, _)) in enumerate(zip(ranges, ranges[1:]), start=n_enc):
            if start != end:
                raise PlanError(
                    f"{who}: LLM layer ranges {ranges} are not contiguous (plan.stages[{i}] "
                    f"ends at {end}, plan.stages[{i + 1}] starts at {start})"
                )
        return ranges

    def fingerprint(self) -> str:
        """Short hash of the layout and microbatching: resume state refuses a different plan."""
        key = json.dumps(
            {
                k: v
                for k, v in self.to_dict().items()
                if k
                in (
                    "dp",
                    "tp",
                    "pp",
                    "microbatches",
                    "global_batch",
                    "max_tokens",
                    "defer_budget",
                    "method",
                    "model",
                )
                # new fields count only when set, so earlier plans keep their fingerprint
                # (stage_shares: the assignment prices on them, so they shape the stream)
                or (k in ("max_encoder_patches", "max_delay", "stage_shares") and v)
            },
            sort_keys=True,
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def with_method(self, method: str) -> ParallelPlan:
        """The same layout with another assignment method (for comparisons)."""
        return replace(self, method=method)

    # ------------------------------------------------------ (de)serialising
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form of the whole plan; :meth:`from_dict` validates it back."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["stages"] = [s.to_dict() for s in self.stages]
        d["memory_gb"] = list(self.memory_gb)
        return d

    def to_json(self) -> str:
        """The plan as indented JSON text (what ``entrain-data plan`` writes)."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any], origin: str = "<plan>") -> ParallelPlan:
        if not isinstance(d, dict):
            raise InvalidInput(f"{origin}: a plan must be a JSON object")
        missing = [k for k, f in cls.__dataclass_fields__.items() if _required(f) and k not in d]
        if missing:
            raise InvalidInput(f"{origin}: plan is missing field(s) {', '.join(missing)}")
        try:
            return cls(**plan_kwargs(d, set(cls.__dataclass_fields__), StageSegment, StagePlan))
        except InvalidInput as exc:  # PlanError stays PlanError
            raise type(exc)(f"{origin}: {exc}") from exc

    @classmethod
    def from_json(cls, text: str, origin: str = "<plan>") -> ParallelPlan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{origin}: not valid JSON ({exc})") from exc
        return cls.from_dict(d, origin)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON to ``path`` (parents created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ParallelPlan:
        path = Path(path)
        if not path.is_file():
            raise InvalidInput(f"plan file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"{path}: not a UTF-8 JSON plan ({exc.reason})") from exc
        return cls.from_json(text, origin=str(path))
