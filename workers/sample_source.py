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
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from entrain_data.protocol import DTYPES

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
    "field_problems",
    "wire_array",
    "describe",
    "advice",
    "WIRE_NOTE",
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
    A sample whose ``dataset[i]`` raises, whose fields (default collate) differ from
    ``dataset[0]``'s or hold what the wire cannot carry (a str, bfloat16, ...), or that the
    collate cannot batch, is a ``SampleError`` naming ``dataset[i]``; under ``on_error="skip"``
    it is left out of both sets and listed, as an index's bad samples are (not a worker crash).
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


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported
    return torch is not None and isinstance(value, torch.Tensor)


WIRE_NOTE = "the wire carries only tensors of " + ", ".join(DTYPES)


def describe(value: Any) -> str:
    """A field's value as a user would name it: ``a str``, ``a bfloat16 tensor``, ``None``."""
    if value is None:
        return "None"
    if _is_tensor(value):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor"
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array"
    if isinstance(value, (list, tuple)) and value:
        return f"a {type(value).__name__} of {describe(value[0]).removeprefix('a ')}"
    t = type(value)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"a {name}"


def advice(value: Any) -> str:
    """What to do with a value the wire cannot carry (strings, dicts, bfloat16, objects)."""
    inner = value[0] if isinstance(value, (list, tuple)) and value else value
    dtype = str(getattr(inner, "dtype", ""))
    if dtype.endswith("bfloat16"):
        return "return it as float32 (or float16) and cast it to bfloat16 on the device"
    where = "in the dataset or a collate_fn, or drop the field"
    kind = getattr(getattr(inner, "dtype", None), "kind", "")  # a torch dtype has no kind
    if dtype.startswith("torch.") or kind in ("i", "u", "f", "c", "b"):  # numbers, not carried
        return f"cast it to one the wire carries (int32/int64, float32/float16) {where}"
    if isinstance(inner, (str, bytes)) or kind in ("U", "S"):
        return f"turn the text into token ids (an integer tensor) {where}"
    if isinstance(inner, Mapping):
        return f"give its parts as top-level fields {where}"
    return (
        "turn it into a tensor in the dataset (a transform: torchvision's PILToTensor for an "
        "image) or in a collate_fn, or drop the field"
    )


def wire_array(value: Any) -> np.ndarray | None:
    """A collated field as the numpy array the wire carries, or None where it cannot."""
    try:
        if _is_tensor(value):
            if str(value.dtype) == "torch.bfloat16":  # .numpy() would raise a bare TypeError
                return None
            value = value.detach().cpu().numpy()
        arr = np.asarray(value)
    except (TypeError, ValueError, RuntimeError):  # ragged lists, unsupported torch dtypes
        return None
    if arr.dtype.name not in DTYPES:
        return None
    return arr.astype(arr.dtype.newbyteorder("=")) if arr.dtype.byteorder == ">" else arr


def _kind(value: Any) -> Any:
    """What torch's default collate batches alike: arrays, numbers, else the type itself."""
    if isinstance(value, np.ndarray) or _is_tensor(value):
        return "array"
    if isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        return "number"
    return type(value)


def _value_problem(value: Any) -> bool:
    """Whether torch's default collate of this value gives something the wire cannot carry."""
    if isinstance(value, (list, tuple)):
        return any(_value_problem(v) for v in value)
    if _kind(value) == "number":
        return False
    return _kind(value) != "array" or wire_array(value) is None


def field_problems(sample: Mapping[Any, Any], ref: Mapping[Any, Any] | None = None) -> list[str]:
    """The fields of a dict sample that torch's default collate cannot bring onto the wire or
    (given ``ref``, dataset[0]) cannot batch with ``ref``'s: a decision from the sample alone."""
    out = []
    for name, value in sample.items():
        what = f"field {str(name)!r} is {describe(value)}"
        if _value_problem(value):
            out.append(f"{what}: {advice(value)}")
            continue
        other = None if ref is None else ref[name]
        if ref is None or _kind(other) == "number" == _kind(value):
            continue
        if _kind(other) != _kind(value):
            out.append(f"{what}, dataset[0]'s {describe(other)}")
        elif _kind(value) == "array" and tuple(value.shape) != tuple(other.shape):
            out.append(
                f"{what} of shape {tuple(value.shape)}, dataset[0]'s of {tuple(other.shape)} "
                "(the default collate stacks them: a collate_fn that pads them if sizes vary)"
            )
    return out


class _Unbatchable(Exception):
    """The collate failed on a set of samples, or gave what the wire cannot carry."""


class _DatasetPacker:
    """Items loaded one by one (a failing ``dataset[i]`` is named). With torch's default
    collate, which joins dict items field by field, an item whose fields differ from
    ``dataset[0]``'s, or one whose field the wire cannot carry or stack with dataset[0]'s, is
    named too: decided from the item alone, so the same in every microbatch that holds it (its
    encoder set and its LLM set). A user's collate_fn may accept items that differ (it decides);
    where it fails on a set, or gives what the wire cannot carry, each item is collated with
    ``dataset[0]`` and those that fail are named; that decision is taken only where a set
    fails. A set that fails although each item collates with dataset[0] names its rows."""

    def __init__(
        self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None, on_error: str = "skip"
    ) -> None:
        from torch.utils.data import default_collate

        if on_error not in ("raise", "skip"):
            from entrain_data.errors import InvalidInput

            raise InvalidInput(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.dataset, self.on_error = dataset, on_error
        self.collate = collate_fn or default_collate
        self._default = self.collate is default_collate  # a DataLoader's own, or None

    @cached_property
    def _first(self) -> Any:
        """``dataset[0]`` (wrap checked that sample), or None where it cannot be read here."""
        try:
            return self.dataset[0]
        except Exception:  # named where it is packed, if ever
            return None

    def _problem(self, item: Any) -> str | None:
        """Why the default collate cannot batch ``item`` with dataset[0], from the item alone."""
        ref = self._first
        if not self._default or not isinstance(ref, Mapping) or not ref:
            return None
        if not isinstance(item, Mapping):
            return f"is {describe(item)}, dataset[0] a dict"
        if frozenset(item) != frozenset(ref):
            return (
                f"fields {sorted(map(str, item))} differ from dataset[0]'s {sorted(map(str, ref))}"
            )
        problems = field_problems(item, ref)
        return f"{'; '.join(problems)} ({WIRE_NOTE})" if problems else None

    def _bad(self, row: int, why: str, skipped: list[dict[str, str]]) -> None:
        """Raise a SampleError naming ``dataset[row]``, or (skip) list it."""
        from entrain_data.errors import SampleError

        exc = SampleError(f"dataset[{row}]: {why}", source="dataset", key=str(row))
        if self.on_error == "raise":
            raise exc
        log.warning("skipping sample: %s", exc)
        skipped.append({"key": str(row), "source": "dataset", "error": str(exc)})

    def _pack(self, samples: list[Any]) -> dict[str, np.ndarray]:
        """Collate and convert to wire arrays; :class:`_Unbatchable` says why not."""
        if not samples:
            return {}
        try:
            batch = self.collate(samples)
        except Exception as exc:
            raise _Unbatchable(f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(batch, Mapping):
            raise _Unbatchable(f"collate_fn gave a {type(batch).__name__}, not a dict of tensors")
        out = {}
        for name, value in batch.items():
            arr = wire_array(value)
            if arr is None:
                raise _Unbatchable(
                    f"field {str(name)!r} is {describe(value)}: {advice(value)} ({WIRE_NOTE})"
                )
            out[str(name)] = arr
        return out

    def _culprits(self, rows: list[int], items: dict[int, Any]) -> dict[int, str]:
        """The rows whose item does not collate with dataset[0] (alone, without a reference)."""
        ref, bad = self._first, {}
        try:
            if ref is not None:
                self._pack([ref, ref])
        except _Unbatchable:  # the collate cannot batch two items at all: each alone
            ref = None
        for i in rows:
            try:
                self._pack([items[i]] if ref is None else [ref, items[i]])
            except _Unbatchable as exc:
                bad[i] = f"collate_fn fails on it{'' if ref is None else ' with dataset[0]'}: {exc}"
        return bad

    def __call__(self, encoder_rows: list[int], llm_rows: list[int]) -> Packed:
        from entrain_data.errors import SampleError

        skipped: list[dict[str, str]] = []
        items: dict[int, Any] = {}
        for i in dict.fromkeys([*encoder_rows, *llm_rows]):
            try:
                item = self.dataset[i]
            except Exception as exc:  # the user's __getitem__: name the sample
                self._bad(i, f"{type(exc).__name__}: {exc}", skipped)
                continue
            why = self._problem(item)
            if why is not None:
                self._bad(i, why, skipped)
                continue
            items[i] = item
        while True:  # each round names at least one item, or stops
            enc = [i for i in encoder_rows if i in items]
            llm = [i for i in llm_rows if i in items]
            sets = [(llm, "")] + ([(enc, "encoder/")] if sorted(enc) != sorted(llm) else [])
            tensors: dict[str, np.ndarray] = {}
            try:
                for rows, prefix in sets:
                    failing = rows
                    packed = self._pack([items[i] for i in rows])
                    tensors.update((prefix + k, v) for k, v in packed.items())
                break
            except _Unbatchable as exc:
                bad = self._culprits(failing, items)
                if not bad:
                    raise SampleError(
                        f"collate_fn failed on dataset{failing[:8]}: {exc}",
                        source="dataset",
                        key=str(failing[0]),
                    ) from exc
                for i, why in bad.items():
                    self._bad(i, why, skipped)
                    del items[i]
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
