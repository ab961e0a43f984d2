"""A user's torch Dataset with no index and no plan file: profile it, derive the plan from it.

Two ways to describe a dataset, both called once per sample in the parent, before any worker
starts (so they must be cheap: read sizes from metadata, never decode):

- ``sizes_fn(i)`` returns the sample's sizes, a :class:`~entrain_data.metadata.SampleMeta` or a
  mapping ``{"text_tokens": int, "images": [(h, w) | (frames, h, w), ...], "audio_seconds":
  [float, ...]}``. They become a :class:`SampleTable`, the same table an index holds, so the
  static planner (:func:`~entrain_data.planner.make_plan`) and the cost model price it exactly as
  they price an indexed dataset.
- ``cost_fn(i)`` returns ``(encoder_cost, llm_cost, tokens)`` in any consistent unit. Without
  sizes there is no model to lay out, so the plan is data parallel only (one stage per replica):
  its token cap holds a replica's share of the heaviest possible global batch.

Public API: ``table_from_sizes``, ``costs_from_fn``, ``plan_from_costs``, ``plan_for_dataset``,
``local_gpu_memory_gb``, ``table_costs``, ``table_encoder_stats``, ``TableCosts``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidInput
from .metadata import SampleMeta, SampleTable, VisionItem
from .plan import Cluster, ParallelPlan, StagePlan, StageSegment
from .presets import ModelSpec

__all__ = [
    "table_from_sizes",
    "costs_from_fn",
    "plan_from_costs",
    "plan_for_dataset",
    "local_gpu_memory_gb",
    "table_costs",
    "table_encoder_stats",
    "TableCosts",
]


def _vision_item(i: int, item: Any) -> VisionItem:
    if isinstance(item, VisionItem):
        return item
    try:
        dims = [int(x) for x in item]
    except (TypeError, ValueError):
        raise InvalidInput(
            f"sizes_fn({i}): an image must be (height, width) or (frames, height, width), got {item!r}"
        ) from None
    if len(dims) == 2:
        return VisionItem(1, dims[0], dims[1])
    if len(dims) == 3:
        return VisionItem(*dims)
    raise InvalidInput(f"sizes_fn({i}): an image must have 2 or 3 sizes, got {item!r}")


def _sizes_record(i: int, s: Mapping[str, Any], name: str) -> SampleMeta:
    """One ``sizes_fn(i)`` mapping as a record; ``None`` images or audio mean none."""
    t = s["text_tokens"]
    number = not isinstance(t, bool) and isinstance(t, (int, float, np.integer, np.floating))
    if not (number and math.isfinite(t) and t == int(t)):
        raise InvalidInput(f"sizes_fn({i}): text_tokens must be a whole number, got {t!r}")
    imgs, auds = s.get("images"), s.get("audio_seconds")
    imgs, auds = (() if imgs is None else imgs), (() if auds is None else auds)
    if not isinstance(imgs, (list, tuple, np.ndarray)):
        raise InvalidInput(f"sizes_fn({i}): images must be a list of sizes, got {imgs!r}")
    if not isinstance(auds, (list, tuple, np.ndarray)):
        raise InvalidInput(f"sizes_fn({i}): audio_seconds must be a list, got {auds!r}")
    try:
        secs = tuple(float(x) for x in auds)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"sizes_fn({i}): audio_seconds: {exc}") from exc
    images = tuple(_vision_item(i, it) for it in imgs)
    return SampleMeta(str(i), name, int(t), images, secs, row=i)


def table_from_sizes(
    length: int, sizes_fn: Callable[[int], Any], *, name: str = "<dataset>"
) -> SampleTable:
    """The dataset as an index would hold it: keys are the indices as strings, rows the indices."""
    records = []
    for i in range(length):
        s = sizes_fn(i)
        if isinstance(s, SampleMeta):
            records.append(
                SampleMeta(str(i), name, s.text_tokens, s.images, s.audio_seconds, row=i)
            )
            continue
        if not isinstance(s, Mapping):
            raise InvalidInput(f"sizes_fn({i}) returned a {type(s).__name__}, expected a mapping")
        unknown = set(s) - {"text_tokens", "images", "audio_seconds"}
        if unknown or "text_tokens" not in s:
            raise InvalidInput(
                f"sizes_fn({i}): fields are text_tokens (required), images, audio_seconds; "
                f"got {sorted(s)}"
            )
        try:
            records.append(_sizes_record(i, s, name))
        except InvalidInput as exc:  # a VisionItem's or SampleMeta's check: name the call
            msg = str(exc)
            raise InvalidInput(
                msg if msg.startswith("sizes_fn(") else f"sizes_fn({i}): {msg}"
            ) from None
    if not records:
        raise InvalidInput(f"{name}: the dataset is empty")
    return SampleTable.from_records(records, origin=name)


def costs_from_fn(
    length: int, cost_fn: Callable[[int], Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(encoder [N, 1], llm [N], tokens [N])`` from ``cost_fn(i) -> (enc, llm, tokens)``."""
    out = np.zeros((length, 3), dtype=np.float64)
    for i in range(length):
        v = cost_fn(i)
        try:
            enc, llm, tok = (float(x) for x in v)
        except (TypeError, ValueError):
            raise InvalidInput(
                f"cost_fn({i}) must return (encoder_cost, llm_cost, tokens), got {v!r}"
            ) from None
        if not all(math.isfinite(x) and x >= 0 for x in (enc, llm, tok)) or tok != int(tok):
            raise InvalidInput(
                f"cost_fn({i}) = {v!r}: costs must be finite and >= 0, tokens a whole number"
            )
        out[i] = enc, llm, tok
    if length == 0:
        raise InvalidInput("cost_fn: the dataset is empty")
    return out[:, :1], out[:, 1], out[:, 2].astype(np.int64)


def _caps(tokens: np.ndarray, dp: int, microbatches: int, global_batch: int) -> tuple[int, int]:
    """Token cap that fits every possible global batch, and a deferral budget.

    A global batch holds at most the ``global_batch`` longest samples; a replica's balanced share
    of it is within one sample of total / dp, spread over ``microbatches``.
    """
    top = np.sort(tokens)[::-1][:global_batch]
    biggest = int(tokens.max())
    share = int(math.ceil(float(top.sum()) / (dp * microbatches)))
    cap = max(biggest, share + biggest)
    mean_mb = float(tokens.mean()) * global_batch / (dp * microbatches)
    return int(math.ceil(cap / 256) * 256), int(math.ceil(2 * mean_mb))


def plan_from_costs(
    tokens: np.ndarray, *, dp: int, global_batch: int, microbatches: int = 1, gpus_per_node: int = 8
) -> ParallelPlan:
    """A data-parallel plan (one stage per replica) for a dataset priced by a ``cost_fn``."""
    if global_batch % dp:
        raise InvalidInput(f"global batch {global_batch} does not split over {dp} replicas")
    if global_batch > len(tokens):
        raise InvalidInput(
            f"global batch {global_batch} is larger than the dataset ({len(tokens)})"
        )
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) and tokens.max() < 1:
        raise InvalidInput(
            "every sample has 0 tokens: cost_fn(i) -> (encoder_cost, llm_cost, tokens) must "
            "give each sample its LLM tokens (what the loss runs on), at least one"
        )
    cap, budget = _caps(tokens, dp, microbatches, global_batch)
    return ParallelPlan(
        world_size=dp,
        gpus_per_node=min(gpus_per_node, dp),
        dp=dp,
        tp=1,
        pp=1,
        stages=(StagePlan(0, (StageSegment("llm", None, 0, 1, True, True),)),),
        microbatches=microbatches,
        global_batch=global_batch,
        max_tokens=cap,
        defer_budget=budget,
        search={"source": "cost_fn"},
    )


def plan_for_dataset(
    length: int,
    *,
    dp: int,
    global_batch: int,
    sizes_fn: Callable[[int], Any] | None = None,
    cost_fn: Callable[[int], Any] | None = None,
    model: ModelSpec | Mapping[str, Any] | None = None,
    microbatches: int | None = None,
    gpus_per_node: int = 8,
    seed: int = 0,
    name: str = "<dataset>",
    gpu_memory_gb: float | None = None,
) -> tuple[ParallelPlan, SampleTable | None]:
    """The static plan for ``dp`` data-parallel ranks, from sizes (with ``model``) or costs.

    With ``sizes_fn`` the planner lays out ``model`` (a ModelSpec or its dict) pinned to the
    ranks the training loop has (dp = ranks, no tensor or pipeline split) and picks the
    microbatch count unless given; the table is returned for :class:`TableCosts`.
    ``gpu_memory_gb``: each GPU's memory, for the plan's memory check and token cap (default:
    this process's first CUDA device, else 80 GB); a model that does not fit is refused here
    rather than running out of memory in training.
    """
    if (sizes_fn is None) == (cost_fn is None):
        raise InvalidInput("describe the dataset with exactly one of sizes_fn or cost_fn")
    if sizes_fn is None:
        _, _, tokens = costs_from_fn(length, cost_fn)
        plan = plan_from_costs(
            tokens,
            dp=dp,
            global_batch=global_batch,
            microbatches=microbatches or 1,
            gpus_per_node=gpus_per_node,
        )
        return plan, None
    if model is None:
        raise InvalidInput("sizes_fn needs a model (a ModelSpec, e.g. ModelSpec.from_names(...))")
    from .planner import make_plan

    spec = ModelSpec.from_dict(dict(model)) if isinstance(model, Mapping) else model
    table = table_from_sizes(length, sizes_fn, name=name)
    memory = gpu_memory_gb if gpu_memory_gb is not None else local_gpu_memory_gb()
    cluster = Cluster(world_size=dp, gpus_per_node=min(gpus_per_node, dp), gpu_memory_gb=memory)
    plan = make_plan(
        table, spec, cluster, global_batch, dp=dp, tp=1, pp=1, microbatches=microbatches, seed=seed
    )
    return plan, table


def local_gpu_memory_gb(default: float = 80.0) -> float:
    """This process's first CUDA device's memory in GiB (an 80 GB H100 reads 79.2), or
    ``default`` without one (a CPU process planning for GPUs it does not see)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 2**30
    except (ImportError, RuntimeError):  # a broken CUDA setup plans as a CPU process does
        pass
    return default


def table_costs(
    table: SampleTable, plan: ParallelPlan, costs: Any = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample (encoder cost [N, G] per ``plan.cost_columns()`` column, LLM cost, LLM
    tokens) of ``table`` under ``plan``: what the loader service balances. ``costs``: the
    table's :class:`~entrain_data.cost_model.SampleCosts` under the plan's model and
    calibration, where the caller has them already."""
    from .cost_model import per_sample_costs

    if costs is None:
        costs = per_sample_costs(table, plan.model_spec(), calibration=plan.calibration)
    return plan.column_costs(costs.encoder_cost()), costs.llm_cost(), np.asarray(costs.llm_tokens)


def table_encoder_stats(
    table: SampleTable, plan: ParallelPlan, costs: Any = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per sample of ``table``: its encoder patches, [N, G] per ``plan.cost_columns()``
    column as :func:`table_costs` prices them (the memory model holds the plan's patch cap for
    every encoder segment a stage holds, so capping each column's set by it is safe), and
    which encoders it uses (``{"vision": bool[N], "audio": bool[N]}``). What the loader
    service needs for the patch cap and the group-wide encoder calls; a table is enough, no
    calibration (``costs`` as for :func:`table_costs`)."""
    from .cost_model import per_sample_costs

    costs = costs if costs is not None else per_sample_costs(table, plan.model_spec())
    pt = costs.encoder_tokens.astype(np.int64)
    patches = plan.column_costs(pt) if pt.shape[1] else pt.sum(axis=1)
    uses = {
        "vision": np.diff(table.image_offsets) > 0,
        "audio": np.diff(table.audio_offsets) > 0,
    }
    return patches, uses


@dataclass(frozen=True)
class TableCosts:
    """Picklable ``table_costs`` for the loader service (computed in its coordinator)."""

    table: SampleTable
    plan_json: str

    def __call__(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return table_costs(self.table, ParallelPlan.from_json(self.plan_json))
