"""Field checks of the plan's value types, shared by their ``__post_init__`` and ``from_dict``.

A plan is read by every part of the system (the loader service, the adapters), often from a
file someone edited; a bad field must be refused where the plan is loaded, with the field's
name, not met later as a ``TypeError`` deep inside the service or as a wrong layout. Kept
apart from :mod:`.plan` so that module stays about the plan's meaning.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from .errors import InvalidInput, PlanError

__all__ = [
    "is_int",
    "require_int",
    "require_number",
    "require_bool",
    "check_plan_fields",
    "check_plan_model",
    "check_segment",
    "plan_kwargs",
]


def is_int(v: Any) -> bool:
    """A whole number that is not a bool (JSON ``true`` must not pass as 1)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def require_int(where: str, name: str, v: Any, low: int) -> int:
    """``v`` as an int >= ``low``; InvalidInput naming ``where``'s field ``name`` otherwise."""
    if not is_int(v) or v < low:
        want = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise InvalidInput(f"{where}: field {name!r} must be {want}, got {v!r}")
    return int(v)


def require_number(where: str, name: str, v: Any, finite: bool = True) -> float:
    """``v`` as a float (not a bool, not a string); finite unless ``finite`` is False (the
    plan's reported gaps may be NaN for a degenerate workload and still load)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or (finite and not math.isfinite(v)):
        what = "a finite number" if finite else "a number"
        raise InvalidInput(f"{where}: field {name!r} must be {what}, got {v!r}")
    return float(v)


def require_bool(where: str, name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise InvalidInput(f"{where}: field {name!r} must be true or false, got {v!r}")
    return v


def check_plan_fields(plan: Any) -> None:
    """Types and ranges of every scalar field of a :class:`~entrain_data.plan.ParallelPlan`."""
    from .assignment import METHODS  # lazy: the plan module stays light to import
    from .simulator import SCHEDULES

    for f in ("world_size", "gpus_per_node", "dp", "tp", "pp", "microbatches", "global_batch"):
        require_int("plan", f, getattr(plan, f), 1)
    require_int("plan", "max_tokens", plan.max_tokens, 1)
    for f in ("max_encoder_patches", "max_delay", "defer_budget"):
        require_int("plan", f, getattr(plan, f), 0)
    require_int("plan", "schema_version", plan.schema_version, 1)
    for f in ("expected_iteration_time", "ideal_iteration_time", "oracle_gap", "worst_static_gap"):
        require_number("plan", f, getattr(plan, f), finite=False)
    for i, m in enumerate(plan.memory_gb):
        require_number("plan", f"memory_gb[{i}]", m, finite=False)
    require_bool("plan", "recompute", plan.recompute)
    if plan.schedule not in SCHEDULES:
        raise InvalidInput(
            f"plan: field 'schedule' is {plan.schedule!r}, choose one of {', '.join(SCHEDULES)}"
        )
    if plan.method not in METHODS:
        raise InvalidInput(
            f"plan: field 'method' is {plan.method!r}, choose one of {', '.join(METHODS)}"
        )
    for f, kinds in (("model", (dict,)), ("search", (dict,)), ("calibration", (dict, type(None)))):
        if not isinstance(getattr(plan, f), kinds):
            want = "an object" + (" or null" if f == "calibration" else "")
            raise InvalidInput(f"plan: field {f!r} must be {want}, got {getattr(plan, f)!r}")


def check_plan_model(plan: Any) -> None:
    """The saved model (when there is one) parses, and every stage segment names one of its
    modules and stays inside its layers: a plan past the model's last layer is refused at
    load, not when an adapter builds its stages."""
    if not plan.model:
        return
    from .presets import ModelSpec

    try:
        spec = ModelSpec.from_dict(plan.model)
    except InvalidInput as exc:
        raise InvalidInput(f"plan: field 'model': {exc}") from exc
    for i, st in enumerate(plan.stages):
        for j, seg in enumerate(st.segments):
            where = f"plan: stages[{i}].segments[{j}]"
            if seg.encoder_index is None:
                mod = spec.llm
            elif seg.encoder_index < len(spec.encoders):
                mod = spec.encoders[seg.encoder_index]
            else:
                raise PlanError(
                    f"{where}: encoder_index {seg.encoder_index} but the plan's model has "
                    f"{len(spec.encoders)} encoder(s)"
                )
            if seg.layer_end > mod.layers:
                raise PlanError(
                    f"{where}: layer_end {seg.layer_end} is beyond the {mod.layers} layers of "
                    f"{mod.name!r}"
                )


_SEGMENT_FIELDS = ("module", "encoder_index", "layer_start", "layer_end", "first", "last")


def check_segment(where: str, seg: Any) -> None:
    """A stage segment's fields: a module name, an encoder column or None (the LLM), a layer
    range ``0 <= start <= end`` of integers, and bool ``first``/``last``."""
    if not isinstance(seg.module, str):
        raise InvalidInput(f"{where}: field 'module' must be a string, got {seg.module!r}")
    if seg.encoder_index is not None:
        require_int(where, "encoder_index", seg.encoder_index, 0)
    start = require_int(where, "layer_start", seg.layer_start, 0)
    if require_int(where, "layer_end", seg.layer_end, 0) < start:
        raise InvalidInput(f"{where}: bad layer range [{start}, {seg.layer_end})")
    require_bool(where, "first", seg.first)
    require_bool(where, "last", seg.last)


def _segment(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise InvalidInput(f"{where} must be an object, got {d!r}")
    missing = [k for k in _SEGMENT_FIELDS if k not in d]
    if missing:
        raise InvalidInput(f"{where} is missing field(s) {', '.join(missing)}")
    fields = {k: d[k] for k in _SEGMENT_FIELDS}
    check_segment(where, SimpleNamespace(**fields))
    return fields


def _stage(d: Any, where: str, segment_cls: type, stage_cls: type) -> Any:
    if not isinstance(d, Mapping):
        raise InvalidInput(f"{where} must be an object, got {d!r}")
    segs = d.get("segments")
    if not isinstance(segs, list) or not segs:
        raise InvalidInput(f"{where}: field 'segments' must be a non-empty list, got {segs!r}")
    return stage_cls(
        require_int(where, "index", d.get("index"), 0),
        tuple(
            _built(segment_cls, _segment(s, f"{where}.segments[{j}]"), f"{where}.segments[{j}]")
            for j, s in enumerate(segs)
        ),
        require_number(where, "expected_load", d.get("expected_load", 0.0)),
        require_bool(where, "recompute", d.get("recompute", False)),
    )


def _built(cls: type, kwargs: dict[str, Any], where: str) -> Any:
    """``cls(**kwargs)`` with its InvalidInput said at ``where`` (the JSON path)."""
    try:
        return cls(**kwargs)
    except InvalidInput as exc:
        raise type(exc)(f"{where}: {exc}") from exc


def plan_kwargs(
    d: Mapping[str, Any], known: set[str], segment_cls: type, stage_cls: type
) -> dict[str, Any]:
    """The constructor arguments of a plan from its JSON object: the stages and the memory
    list typed, every other known field passed on for the plan's own checks."""
    kwargs = {k: v for k, v in d.items() if k in known}
    stages = d["stages"]
    if not isinstance(stages, list) or not stages:
        raise InvalidInput(f"plan: field 'stages' must be a non-empty list, got {stages!r}")
    kwargs["stages"] = tuple(
        _stage(s, f"plan: stages[{i}]", segment_cls, stage_cls) for i, s in enumerate(stages)
    )
    memory = d.get("memory_gb", [])
    if not isinstance(memory, list):
        raise InvalidInput(f"plan: field 'memory_gb' must be a list of numbers, got {memory!r}")
    kwargs["memory_gb"] = tuple(memory)
    return kwargs
