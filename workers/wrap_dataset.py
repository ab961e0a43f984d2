"""``EntrainLoader.wrap`` on a plain torch Dataset or DataLoader: no index, no plan file needed.

Everything is decided in the caller, before a process starts, so a mistake is one clear
:class:`~entrain_data.errors.InvalidInput` instead of a hang or a worker that dies:

- the dataset is profiled once through ``sizes_fn`` or ``cost_fn``
  (:mod:`entrain_data.dataset_profile`) and, without a ``plan``, the plan is derived from it,
  for GPUs of ``gpu_memory_gb`` (default: this process's CUDA device, else 80 GB): a model
  that does not fit them is refused here;
- the DataLoader's settings are respected or refused: ``batch_size`` is the per-rank batch
  (global batch = batch_size x dp); ``shuffle=False`` is refused (each epoch is a seeded
  permutation, the balancing draws its global batches from it); ``drop_last=False`` is refused
  when the dataset does not divide into global batches (the service never serves a partial
  one); a custom sampler or batch sampler is refused;
- tuple samples are named by ``fields`` (``("pixels", "label")``) before collation;
- ``dataset[0]`` is collated here: a field the wire cannot carry (only numeric tensors cross it:
  no str, dict, bfloat16, image or None) is refused by name, with what to do instead; a later
  item with such a field is named and skipped under ``on_error`` (see ``DatasetSource``);
- ``cost_fn``/``sizes_fn``, dataset and collate must pickle (spawn sends them to the
  processes); a script without ``if __name__ == "__main__":`` is named as such.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from entrain_data.dataset_profile import (
    costs_from_fn,
    plan_for_dataset,
    table_costs,
    table_encoder_stats,
)
from entrain_data.errors import InvalidInput
from entrain_data.plan import ParallelPlan

from .sample_source import (
    WIRE_NOTE,
    Costs,
    DatasetSource,
    Packer,
    advice,
    describe,
    field_problems,
    wire_array,
)

__all__ = ["WrapSpec", "prepare_wrap", "NamedFields", "ProfiledDataset"]


class NamedFields:
    """A dataset whose samples are tuples, seen as dicts ``{field: part}`` (picklable)."""

    def __init__(self, dataset: Any, fields: Sequence[str]) -> None:
        self.dataset, self.fields = dataset, tuple(fields)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = self.dataset[i]
        if not isinstance(sample, (tuple, list)) or len(sample) != len(self.fields):
            n = len(sample) if isinstance(sample, (tuple, list)) else type(sample).__name__
            raise InvalidInput(f"dataset[{i}] is {n}, not a tuple of the fields {self.fields}")
        return dict(zip(self.fields, sample))


@dataclass(frozen=True)
class _FixedCosts:
    enc: np.ndarray
    llm: np.ndarray
    tokens: np.ndarray

    def __call__(self) -> Costs:
        return self.enc, self.llm, self.tokens


@dataclass(frozen=True)
class ProfiledDataset:
    """A wrapped dataset with costs profiled in the caller (a :class:`SampleSource`).

    ``stats``: per sample its patches per cost column and the encoders it uses, known where
    ``sizes_fn`` described the samples (the plan's patch cap and the group-wide encoder calls
    then hold as for an index); None from a ``cost_fn``, which gives no sizes."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None
    profiled: _FixedCosts
    stats: tuple[np.ndarray, dict[str, np.ndarray]] | None = None
    on_error: str = "skip"  # the service's: a bad item is named, and skipped or fatal

    def costs(self) -> Costs:
        return self.profiled()

    def encoder_stats(self) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
        return self.stats

    def keys(self) -> list[str]:
        return [str(i) for i in range(len(self.dataset))]

    def make_packer(self) -> Packer:
        return DatasetSource(self.dataset, None, self.collate_fn, self.on_error).make_packer()  # type: ignore[arg-type]


@dataclass(frozen=True)
class WrapSpec:
    """What :func:`prepare_wrap` decided: the plan, the source, workers and service options."""

    plan: ParallelPlan
    source: ProfiledDataset
    workers: int
    options: dict[str, Any]


def _check_picklable(name: str, obj: Any) -> None:
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise InvalidInput(
            f"{name} cannot be pickled ({type(exc).__name__}: {exc}); the loader's processes are "
            "spawned, so define it at module level (not a lambda or a local function)"
        ) from exc


def _loader_settings(dl: Any) -> tuple[Any, Any, int, int | None]:
    """(dataset, collate_fn, num_workers, per-rank batch size) of a DataLoader, or refusals.

    torch's ``default_collate`` (a DataLoader's unless given one) comes back as None: the
    packer then checks each dict item's fields against dataset[0]'s and skips one that differs."""
    from torch.utils.data import RandomSampler, SequentialSampler, default_collate
    from torch.utils.data.sampler import BatchSampler

    sampler = getattr(dl, "sampler", None)
    if isinstance(sampler, SequentialSampler):
        raise InvalidInput(
            "DataLoader(shuffle=False): EntrainLoader draws every epoch as a seeded permutation "
            "(the balanced assignment picks each global batch from it); build the DataLoader "
            "with shuffle=True, or pass the Dataset itself"
        )
    if not isinstance(sampler, RandomSampler):
        raise InvalidInput(
            f"DataLoader with a {type(sampler).__name__}: EntrainLoader does its own sampling "
            "(every rank gets its balanced share); pass shuffle=True and no sampler"
        )
    if sampler.replacement or sampler.num_samples != len(sampler.data_source):
        raise InvalidInput("DataLoader's RandomSampler draws with replacement or num_samples")
    bs = getattr(dl, "batch_sampler", None)
    if dl.batch_size is None or type(bs) is not BatchSampler:
        raise InvalidInput(
            "DataLoader with a custom batch_sampler or batch_size=None: give batch_size"
        )
    collate = None if dl.collate_fn is default_collate else dl.collate_fn  # fields checked
    return dl.dataset, collate, int(getattr(dl, "num_workers", 0)), int(dl.batch_size)


def _check_first_sample(ds: Any, collate: Any, fields: Sequence[str] | None) -> None:
    """Collate ``dataset[0]`` here: a tuple sample without ``fields``, or a field the wire cannot
    carry (a str, a dict, bfloat16, an image or None), fails now, by name, not in a worker."""
    if len(ds) == 0:
        raise InvalidInput("EntrainLoader.wrap: the dataset is empty")
    sample = ds[0]
    if isinstance(sample, (tuple, list)) and fields is None:
        raise InvalidInput(
            f"dataset[0] is a {type(sample).__name__} of {len(sample)}: name its parts with "
            "fields=('name0', 'name1', ...) so microbatches carry named tensors"
        )
    if collate is None and isinstance(sample, Mapping):  # the default collate: field by field
        problems = field_problems(sample)
        if problems:
            raise InvalidInput(f"dataset[0]: {'; '.join(problems)} ({WIRE_NOTE})")
    if collate is None:
        from torch.utils.data import default_collate as collate
    try:
        batch = collate([sample])
    except Exception as exc:
        raise InvalidInput(
            f"collate_fn([dataset[0]]) failed on {describe(sample)}: {type(exc).__name__}: {exc}; "
            "give dict samples of tensors, or a collate_fn that makes them"
        ) from exc
    if not isinstance(batch, Mapping):
        raise InvalidInput(
            f"collate_fn([dataset[0]]) gave a {type(batch).__name__}; it must give a dict of tensors"
        )
    bad = [
        f"field {str(k)!r} is {describe(v)}: {advice(v)}"
        for k, v in batch.items()
        if wire_array(v) is None
    ]
    if bad:
        raise InvalidInput(f"collate_fn([dataset[0]]) gives {'; '.join(bad)} ({WIRE_NOTE})")


def _world_size(world_size: int | None) -> int:
    if world_size is not None:
        return int(world_size)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except ImportError:
        pass
    return 1


def prepare_wrap(
    dataloader_or_dataset: Any,
    cost_fn: Callable[[int], Any] | None = None,
    *,
    plan: ParallelPlan | str | None = None,
    sizes_fn: Callable[[int], Any] | None = None,
    model: Any = None,
    world_size: int | None = None,
    batch_size: int | None = None,
    microbatches: int | None = None,
    fields: Sequence[str] | None = None,
    workers: int | None = None,
    rank: int = 0,
    gpu_memory_gb: float | None = None,
    **options: Any,
) -> WrapSpec:
    """Check the user's inputs, profile the dataset, derive the plan (see module doc)."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise InvalidInput(
            "EntrainLoader.wrap ran while a loader process was starting: the training script "
            'lacks `if __name__ == "__main__":` around its entry point (spawn re-imports it)'
        )
    ds, collate = dataloader_or_dataset, None
    if hasattr(ds, "dataset") and hasattr(ds, "collate_fn"):  # a DataLoader
        ds, collate, n_workers, loader_bs = _loader_settings(ds)
        workers = workers or max(n_workers, 1)
        if batch_size is not None and batch_size != loader_bs:
            raise InvalidInput(f"batch_size={batch_size} but the DataLoader has {loader_bs}")
        batch_size, drop_last = loader_bs, bool(dataloader_or_dataset.drop_last)
    else:
        drop_last = True  # a bare Dataset: the service's rule (partial global batches dropped)
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise InvalidInput("EntrainLoader.wrap needs a map-style Dataset (__getitem__ and __len__)")
    n = len(ds)
    if fields is not None:
        ds = NamedFields(ds, fields)
    for name, obj in (
        ("cost_fn", cost_fn),
        ("sizes_fn", sizes_fn),
        ("dataset", ds),
        ("collate_fn", collate),
    ):
        if obj is not None:
            _check_picklable(name, obj)
    _check_first_sample(ds, collate, fields)
    if isinstance(plan, str):
        plan = ParallelPlan.load(plan)
    if plan is not None and gpu_memory_gb is not None:
        raise InvalidInput("gpu_memory_gb sizes a plan wrap derives; the plan given is made")
    dp = plan.dp if plan is not None else _world_size(world_size)
    if plan is not None and world_size is not None and world_size != plan.world_size:
        raise InvalidInput(f"world_size={world_size} but the plan is for {plan.world_size} ranks")
    if plan is not None and batch_size is not None and batch_size * plan.dp != plan.global_batch:
        raise InvalidInput(
            f"the DataLoader's batch_size {batch_size} x dp {plan.dp} != the plan's global batch "
            f"{plan.global_batch}"
        )
    global_batch = plan.global_batch if plan is not None else (batch_size or 0) * dp
    if global_batch < 1:
        raise InvalidInput("give batch_size (per rank) or a DataLoader with one, or a plan")
    if not drop_last and n % global_batch:
        raise InvalidInput(
            f"DataLoader(drop_last=False): {n} samples do not fill global batches of {global_batch} "
            f"(batch_size x {dp} ranks); the service never serves a partial global batch, so set "
            "drop_last=True (the last samples of each epoch's permutation are left out)"
        )
    table = None
    if plan is None:
        plan, table = plan_for_dataset(
            n,
            dp=dp,
            global_batch=global_batch,
            sizes_fn=sizes_fn,
            cost_fn=cost_fn,
            model=model,
            microbatches=microbatches,
            gpu_memory_gb=gpu_memory_gb,
        )
    if table is None and sizes_fn is not None:
        from entrain_data.dataset_profile import table_from_sizes

        table = table_from_sizes(n, sizes_fn)
    stats = None
    if table is not None:  # priced once, for the costs and the encoder stats alike
        from entrain_data.cost_model import per_sample_costs

        costs = per_sample_costs(table, plan.model_spec(), calibration=plan.calibration)
        enc, llm, tok = table_costs(table, plan, costs)
        stats = table_encoder_stats(table, plan, costs)
    elif cost_fn is not None:
        enc, llm, tok = costs_from_fn(n, cost_fn)
    else:
        raise InvalidInput("describe the dataset: give cost_fn or sizes_fn")
    on_error = options.get("on_error", "skip")
    source = ProfiledDataset(ds, collate, _FixedCosts(enc, llm, tok), stats, on_error)
    if plan.world_size > 1 and "ranks" not in options:
        options["ranks"] = (rank, rank)  # every rank runs wrap: each serves itself
    return WrapSpec(plan, source, workers or 1, options)
