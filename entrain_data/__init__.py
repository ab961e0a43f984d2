"""entrain_data: workload-balanced multimodal microbatches for distributed MLLM training.

Profile whole global batches, derive one static parallel plan, and serve every
rank microbatches whose encoder and LLM work are balanced (Entrain, arXiv
2605.27918). See ``entrain_data/README.md`` for the package map.

The front door::

    from entrain_data import EntrainLoader, ParallelPlan, make_plan, assign, Microbatch

Names are imported on first use, so ``import entrain_data`` stays cheap (no torch,
pyarrow or ZeroMQ until a name that needs them is touched).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    EntrainError,
    EntrainTimeout,
    InvalidInput,
    PlanError,
    ProtocolError,
    SampleError,
    WorkerDied,
)

__version__ = "0.1.0"

# public name -> the module that defines it (one home per name)
_LAZY = {
    "EntrainLoader": ".client",
    "Microbatch": ".batch",
    "ParallelPlan": ".plan",
    "Cluster": ".plan",
    "make_plan": ".planner",
    "assign": ".assignment",
    "Assignment": ".assignment",
    "METHODS": ".assignment",
    "ModelSpec": ".presets",
    "ModuleConfig": ".presets",
    "per_sample_costs": ".cost_model",
    "macro_profile": ".profiler",
    "SampleMeta": ".metadata",
    "SampleTable": ".metadata",
    "VisionItem": ".metadata",
    "read_index": ".metadata",
    "write_index": ".metadata",
}

__all__ = [
    "EntrainLoader",
    "Microbatch",
    "ParallelPlan",
    "Cluster",
    "make_plan",
    "assign",
    "Assignment",
    "METHODS",
    "ModelSpec",
    "ModuleConfig",
    "per_sample_costs",
    "macro_profile",
    "SampleMeta",
    "SampleTable",
    "VisionItem",
    "read_index",
    "write_index",
    "EntrainError",
    "EntrainTimeout",
    "InvalidInput",
    "PlanError",
    "ProtocolError",
    "SampleError",
    "WorkerDied",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'entrain_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # static tools see the real names
    from .assignment import METHODS, Assignment, assign
    from .batch import Microbatch
    from .client import EntrainLoader
    from .cost_model import per_sample_costs
    from .metadata import SampleMeta, SampleTable, VisionItem, read_index, write_index
    from .plan import Cluster, ParallelPlan
    from .planner import make_plan
    from .presets import ModelSpec, ModuleConfig
    from .profiler import macro_profile
