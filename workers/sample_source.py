"""A *sample source*: what the service serves, as one picklable object with two halves.

The coordinator needs every sample's costs (to balance) and keys (to name what it
could not deliver); each worker needs a packer (to read, decode and pack table
rows). Both halves describe the same samples, so they live in one object:

- :class:`IndexSource`: the samples of an ``entrain-data index`` file, priced by
  the plan's cost model and packed by :func:`.packing.make_packer`;
- :class:`DatasetSource`: a user's torch ``Dataset``, priced by the user's
  ``cost_fn`` and packed by its ``collate_fn`` (``EntrainLoader.wrap``);
- :class:`CustomSource`: any packer recipe plus any cost function (tests, benches).

A source crosses the spawn boundary twice (to the coordinator, then to each
worker), so it holds paths and recipes, never open files or sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "Packed",
    "Packer",
    "Costs",
    "SampleSource",
    "IndexSource",
    "DatasetSource",
    "CustomSource",
    "encoder_stats",
]

Costs = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(encoder cost [N, E], LLM cost [N], LLM tokens [N]) over every sample of a source."""


@dataclass
class Packed:
    """A packed microbatch as numpy arrays (named as in :mod:`entrain_data.batch`)."""

    encoder_keys: list[str]
    llm_keys: list[str]
    tensors: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {key, source, error}


class Packer(Protocol):
    """Builds one microbatch from table rows (encoder set, LLM set), inside a worker."""

    def __call__(self, encoder_rows: list[int], llm_rows: list[int]) -> Packed: ...


class SampleSource(Protocol):
    """The samples a service serves: costs and keys (coordinator side), a packer (worker side)."""

    def costs(self) -> Costs: ...

    def keys(self) -> list[str] | None: ...

    def make_packer(self) -> Packer: ...


@dataclass(frozen=True)
class IndexSource:
    """The samples of an index file, priced with the plan's model (and calibration).

    ``transform`` (optional, picklable) is applied to every decoded sample;
    ``options`` go to :func:`.packing.make_packer` (model, tokenizer, ...).
    """

    index_path: str
    plan_json: str
    on_error: str = "skip"
    transform: Callable[[Any], Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def costs(self) -> Costs:
        from entrain_data.cost_model import per_sample_costs
        from entrain_data.metadata import read_index
        from entrain_data.plan import ParallelPlan

        table = read_index(self.index_path)
        plan = ParallelPlan.from_json(self.plan_json)
        costs = per_sample_costs(table, plan.model_spec(), calibration=plan.calibration)
        enc = plan.column_costs(costs.encoder_cost())  # the plan's cost columns
        return enc, costs.llm_cost(), np.asarray(costs.llm_tokens)

    def keys(self) -> list[str]:
        from entrain_data.metadata import read_index

        return [str(k) for k in read_index(self.index_path).keys]

    def encoder_stats(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Per sample: its patches per cost column and the encoders it uses, from the index
        alone (:func:`~entrain_data.dataset_profile.table_encoder_stats`)."""
        from entrain_data.dataset_profile import table_encoder_stats
        from entrain_data.metadata import read_index
        from entrain_data.plan import ParallelPlan

        plan = ParallelPlan.from_json(self.plan_json)
        return table_encoder_stats(read_index(self.index_path), plan)

    def identity(self) -> str:
        """A hash of the index file's content: a remote worker must pack the same index."""
        import hashlib

        h = hashlib.sha256()
        with open(self.index_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()[:16]

    def make_packer(self) -> Packer:
        from . import packing

        return packing.make_packer(
            self.index_path, on_error=self.on_error, transform=self.transform, **self.options
        )


@dataclass(frozen=True)
class DatasetSource:
    """A user's torch ``Dataset`` run inside the worker pool (``EntrainLoader.wrap``).

    Rows are dataset indices, keys their ``str``. ``cost_fn(i)`` returns
    ``(encoder_cost, llm_cost, tokens)`` for sample ``i`` from cheap metadata (it is
    called for every index once, in the coordinator). The LLM set is collated with
    ``collate_fn`` (default: torch's ``default_collate``) into a dict of tensors;
    when the encoder set differs (deferral), its collated tensors follow under
    ``encoder/<name>``. Dataset, collate and cost function must be picklable (spawn).
    A sample whose ``dataset[i]`` raises, or (default collate) whose fields differ from
    ``dataset[0]``'s, is a ``SampleError`` naming ``dataset[i]``; under ``on_error="skip"`` it
    is left out of both sets and listed, as an index's bad samples are.
    """

    dataset: Any
    cost_fn: Callable[[int], tuple[float, float, int]]
    collate_fn: Callable[[list[Any]], Any] | None = None
    on_error: str = "skip"

    def costs(self) -> Costs:
        vals = np.array([self.cost_fn(i) for i in range(len(self.dataset))], dtype=np.float64)
        if vals.ndim != 2 or vals.shape[1] != 3:
            from entrain_data.errors import InvalidInput

            raise InvalidInput("cost_fn(i) must return (encoder_cost, llm_cost, tokens)")
        return vals[:, :1], vals[:, 1], vals[:, 2].astype(np.int64)

    def keys(self) -> list[str]:
        return [str(i) for i in range(len(self.dataset))]

    def make_packer(self) -> Packer:
        return _DatasetPacker(self.dataset, self.collate_fn, self.on_error)


class _DatasetPacker:
    """Items loaded one by one (a failing ``dataset[i]`` is named); with the default collate,
    which joins dict items field by field, an item whose fields differ from ``dataset[0]``'s
    is named too: the same decision for a sample in every microbatch that holds it (its
    encoder set and its LLM set), whatever else is there. A custom collate decides itself;
    where it fails, the error names the microbatch's rows."""

    def __init__(
        self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None, on_error: str = "skip"
    ) -> None:
        from torch.utils.data import default_collate

        if on_error not in ("raise", "skip"):
            from entrain_data.errors import InvalidInput

            raise InvalidInput(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.dataset, self.on_error = dataset, on_error
        self.collate = collate_fn or default_collate
        self._check_fields = collate_fn is None

    @cached_property
    def _reference(self) -> frozenset | None:
        """``dataset[0]``'s fields (wrap checked that sample), or None: no check."""
        if not self._check_fields:
            return None
        try:
            first = self.dataset[0]
        except Exception:  # named where it is packed, if ever
            return None
        return frozenset(first) if isinstance(first, Mapping) and first else None

    def _bad(self, row: int, why: str, skipped: list[dict[str, str]]) -> None:
        """Raise a SampleError naming ``dataset[row]``, or (skip) list it."""
        from entrain_data.errors import SampleError

        exc = SampleError(f"dataset[{row}]: {why}", source="dataset", key=str(row))
        if self.on_error == "raise":
            raise exc
        log.warning("skipping sample: %s", exc)
        skipped.append({"key": str(row), "source": "dataset", "error": str(exc)})

    def _collate(
        self, rows: list[int], items: dict[int, Any], prefix: str
    ) -> dict[str, np.ndarray]:
        if not rows:
            return {}
        try:
            batch = self.collate([items[i] for i in rows])
        except Exception as exc:
            from entrain_data.errors import SampleError

            raise SampleError(
                f"collate_fn failed on dataset{rows[:8]}: {type(exc).__name__}: {exc}",
                source="dataset",
                key=str(rows[0]),
            ) from exc
        if not isinstance(batch, dict):
            raise TypeError(f"collate_fn must return a dict of tensors, got {type(batch).__name__}")
        out = {}
        for name, value in batch.items():
            arr = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            out[prefix + str(name)] = arr
        return out

    def __call__(self, encoder_rows: list[int], llm_rows: list[int]) -> Packed:
        skipped: list[dict[str, str]] = []
        items: dict[int, Any] = {}
        for i in dict.fromkeys([*encoder_rows, *llm_rows]):
            try:
                item = self.dataset[i]
            except Exception as exc:  # the user's __getitem__: name the sample
                self._bad(i, f"{type(exc).__name__}: {exc}", skipped)
                continue
            ref = self._reference
            if ref is not None and isinstance(item, Mapping) and frozenset(item) != ref:
                got = sorted(map(str, item))
                self._bad(i, f"fields {got} differ from dataset[0]'s {sorted(map(str, ref))}",
                          skipped)  # fmt: skip
                continue
            items[i] = item
        enc = [i for i in encoder_rows if i in items]
        llm = [i for i in llm_rows if i in items]
        tensors = self._collate(llm, items, "")
        if sorted(enc) != sorted(llm):
            tensors.update(self._collate(enc, items, "encoder/"))
        return Packed([str(i) for i in enc], [str(i) for i in llm], tensors, skipped=skipped)


@dataclass(frozen=True)
class CustomSource:
    """Any packer recipe (``packer_factory() -> Packer``, run in each worker) and cost function.

    ``key_fn`` (optional) names the samples; without it the service names a sample by its row.
    """

    packer_factory: Callable[[], Packer]
    table_costs: Callable[[], Costs]
    key_fn: Callable[[], list[str]] | None = None

    def costs(self) -> Costs:
        return self.table_costs()

    def keys(self) -> list[str] | None:
        return list(self.key_fn()) if self.key_fn is not None else None

    def make_packer(self) -> Packer:
        return self.packer_factory()


def encoder_stats(source: Any) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """``source.encoder_stats()`` where the source knows them (an index), else ``None``."""
    stats = getattr(source, "encoder_stats", None)
    return stats() if stats is not None else None
