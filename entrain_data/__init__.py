"""entrain_data: workload-balanced multimodal microbatches for distributed MLLM training.

Profile whole global batches, derive one static parallel plan, and serve every
rank microbatches whose encoder and LLM work are balanced (Entrain, arXiv
2605.27918). See ``entrain_data/README.md`` for the package map.
"""

from .batch import Microbatch
from .errors import (
    EntrainError,
    EntrainTimeout,
    InvalidInput,
    PlanError,
    ProtocolError,
    SampleError,
    WorkerDied,
)
from .metadata import SampleMeta, SampleTable, VisionItem, read_index, write_index

__version__ = "0.1.0"

__all__ = [
    "Microbatch",
    "EntrainError",
    "EntrainTimeout",
    "InvalidInput",
    "PlanError",
    "ProtocolError",
    "SampleError",
    "WorkerDied",
    "SampleMeta",
    "SampleTable",
    "VisionItem",
    "read_index",
    "write_index",
    "__version__",
]
