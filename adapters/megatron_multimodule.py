"""Megatron-Core multi-module layout: encoder-only pipeline stages (built against 0.16.1).

Encoder-only pipeline stages (multi-module layout): a plan whose leading stages
hold only encoder layers is applied with Megatron-Core 0.16.1's multi-module
pieces, not with ``initialize_model_parallel``::

    grids = module_grids_from_plan(plan)     # {"vision+audio": HyperCommGrid, "llm": ...}
    comm = multimodule_communicator(plan, config, grids)  # MultiModulePipelineCommunicator
    # encoder ranks: comm.send_forward({enc: x}) / comm.recv_backward()[enc]
    # first LLM stage: comm.recv_forward()[enc] / comm.send_backward({enc: grad})
    config = TransformerConfig(..., **llm_transformer_settings(plan))  # the LLM module alone

One grid per module: the encoder stages' ranks, then the LLM stages' ranks,
each with dims ``tp, cp, dp, pp`` in the order of ``plan.rank_coords`` (TP
fastest, then DP, then pipeline), so a rank's place in its module's grid is its
place in the plan. The topology is ``{encoder: [llm], llm: []}``; activations
crossing the bridge are 3-D ``[s, b, h]`` (the bridge exchanges 3-element
shapes). Megatron-Core 0.16.1 has no schedule that drives the multi-module
communicator: ``forward_backward_pipelining_without_interleaving`` takes a
``P2PCommunicator`` and reads its ``pp_group`` (schedules.py:1985, 2094), which
``MultiModulePipelineCommunicator`` has not; the caller runs the microbatches
(e.g. all forwards, then all backwards, which also lets a deferred sample's
encoder gradient arrive once every consumer has run).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInput, PlanError
from ..plan import ParallelPlan
from .common import require_world
from .megatron import _settings_from_counts

__all__ = [
    "GRID_DIMS",
    "BRIDGE_DIM_MAPPING",
    "ModuleLayout",
    "module_layouts",
    "module_topology",
    "module_grids_from_plan",
    "multimodule_communicator",
    "llm_transformer_settings",
]

GRID_DIMS = ("tp", "cp", "dp", "pp")
"""``HyperCommGrid`` dim names, fastest first: the order of ``plan.rank_coords`` (cp is 1)."""

BRIDGE_DIM_MAPPING = {"s": 0, "b": 1, "h": 2}
"""Axes of activations crossing the encoder -> LLM bridge: Megatron's ``[s, b, h]``."""


@dataclass(frozen=True)
class ModuleLayout:
    """One module of a multi-module plan: its pipeline stages and the ranks that run them.

    The plan's rank order puts the pipeline stage slowest, so a module made of
    consecutive stages owns one contiguous block of ranks starting at
    ``rank_offset``; inside it, ranks follow ``plan.rank_coords``.
    """

    name: str
    stages: tuple[int, ...]
    rank_offset: int
    tp: int
    dp: int

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def ranks(self) -> list[int]:
        return list(range(self.rank_offset, self.rank_offset + self.size))

    @property
    def grid_shape(self) -> list[int]:
        """``HyperCommGrid`` shape for :data:`GRID_DIMS`."""
        return [self.tp, 1, self.dp, self.pp]


def _is_encoder_only(stage: Any) -> bool:
    return all(s.encoder_index is not None for s in stage.segments)


def module_layouts(
    plan: ParallelPlan, *, encoder_name: str | None = None, llm_name: str = "llm"
) -> dict[str, ModuleLayout]:
    """The encoder module (the plan's leading encoder-only stages) and the LLM module (the rest).

    Validation names the plan field at fault: encoder-only stages must come
    first, at least one of each kind must exist, and encoder layers may ride
    only on the first LLM stage (where the encoder outputs arrive).
    ``encoder_name`` defaults to the encoder modules of those stages, ``+``-joined.
    """
    stages = list(plan.stages)
    n_enc = 0
    while n_enc < len(stages) and _is_encoder_only(stages[n_enc]):
        n_enc += 1
    if n_enc == 0:
        raise PlanError(
            "megatron multi-module: plan.stages[0] holds LLM layers: no encoder-only stage, so "
            "there is one module; use initialize_from_plan and transformer_settings"
        )
    if n_enc == len(stages):
        raise PlanError(
            f"megatron multi-module: plan.stages: all {n_enc} stages are encoder-only, "
            "no stage holds LLM layers"
        )
    for i, stage in enumerate(stages[n_enc:], start=n_enc):
        if _is_encoder_only(stage):
            raise PlanError(
                f"megatron multi-module: plan.stages[{i}] is encoder-only but follows LLM stage "
                f"{n_enc}; encoder stages must precede every LLM stage"
            )
    plan.llm_layer_ranges("megatron multi-module", encoder_stages=True)
    enc_modules = dict.fromkeys(s.module for st in stages[:n_enc] for s in st.segments)
    enc = encoder_name or "+".join(enc_modules)
    if enc == llm_name:
        raise InvalidInput(f"megatron multi-module: encoder_name and llm_name are both {enc!r}")
    per_stage = plan.tp * plan.dp
    return {
        enc: ModuleLayout(enc, tuple(range(n_enc)), 0, plan.tp, plan.dp),
        llm_name: ModuleLayout(
            llm_name, tuple(range(n_enc, len(stages))), n_enc * per_stage, plan.tp, plan.dp
        ),
    }


def module_topology(layouts: Mapping[str, ModuleLayout]) -> dict[str, list[str]]:
    """``MultiModulePipelineCommunicator`` topology: the encoder module feeds the LLM module."""
    enc, llm = list(layouts)
    return {enc: [llm], llm: []}


def module_grids_from_plan(
    plan: ParallelPlan,
    *,
    encoder_name: str | None = None,
    llm_name: str = "llm",
    backend: str | None = None,
    create_groups: bool = True,
) -> dict[str, Any]:
    """One Megatron-Core ``HyperCommGrid`` per module (see :func:`module_layouts`).

    With ``create_groups`` (a collective: every rank calls it, in the same
    order) each grid gets its ``tp``, ``cp``, ``dp``, ``pp`` and ``dp-cp``
    process groups, whose members are the ranks that share those coordinates
    in ``plan.rank_coords``. ``backend`` None: the default process group's.
    Without groups the grids only describe the layout (``get_rank_enum``); like
    ``HyperCommGrid`` itself they need ``WORLD_SIZE`` or an initialised process group.
    """
    from megatron.core.hyper_comm_grid import HyperCommGrid

    layouts = module_layouts(plan, encoder_name=encoder_name, llm_name=llm_name)
    if create_groups:
        require_world(plan, "module_grids_from_plan")
    grids = {}
    for name, lay in layouts.items():
        grid = HyperCommGrid(
            lay.grid_shape, list(GRID_DIMS), rank_offset=lay.rank_offset, backend=backend
        )
        if create_groups:
            for dims in ("tp", "cp", "dp", "pp", ["dp", "cp"]):
                grid.create_pg(dims)
        grids[name] = grid
    return grids


def multimodule_communicator(
    plan: ParallelPlan,
    config: Any,
    grids: Mapping[str, Any] | None = None,
    *,
    encoder_name: str | None = None,
    llm_name: str = "llm",
) -> Any:
    """Megatron-Core's ``MultiModulePipelineCommunicator`` joining the encoder module's last
    stage to the LLM's first (a collective: it builds the bridge's groups on every rank).

    ``config`` (a ``ModelParallelConfig``/``TransformerConfig``) must set
    ``pipeline_dtype`` (the bridge receives in it) and ``variable_seq_lengths``
    (balanced microbatches differ in length inside each module).
    """
    from megatron.core.pipeline_parallel.multimodule_communicator import (
        MultiModulePipelineCommunicator,
    )

    if getattr(config, "pipeline_dtype", None) is None:
        raise InvalidInput(
            "multimodule_communicator: config.pipeline_dtype is None; the bridge allocates "
            "received activations and gradients in it"
        )
    if not getattr(config, "variable_seq_lengths", False):
        raise InvalidInput(
            "multimodule_communicator: config.variable_seq_lengths is False; balanced "
            "microbatches differ in length"
        )
    layouts = module_layouts(plan, encoder_name=encoder_name, llm_name=llm_name)
    if grids is None:
        grids = module_grids_from_plan(plan, encoder_name=encoder_name, llm_name=llm_name)
    if list(grids) != list(layouts):
        raise InvalidInput(
            f"multimodule_communicator: grids name modules {list(grids)}, "
            f"the plan's are {list(layouts)}"
        )
    for name, lay in layouts.items():
        grid = grids[name]
        got = (list(grid.shape), list(grid.dim_names), grid.rank_offset)
        if got != (lay.grid_shape, list(GRID_DIMS), lay.rank_offset):
            raise InvalidInput(
                f"multimodule_communicator: grids[{name!r}] (shape, dims, rank_offset) = {got}, "
                f"the plan's is {(lay.grid_shape, list(GRID_DIMS), lay.rank_offset)}"
            )
    return MultiModulePipelineCommunicator(
        dict(grids), module_topology(layouts), config, dim_mapping=dict(BRIDGE_DIM_MAPPING)
    )


def llm_transformer_settings(plan: ParallelPlan, *, llm_name: str = "llm") -> dict[str, Any]:
    """:func:`transformer_settings` for the LLM module of a multi-module plan: its own pipeline
    (the LLM stages only) and layer split. The encoders keep their own configs."""
    module_layouts(plan, llm_name=llm_name)
    ranges = plan.llm_layer_ranges("megatron multi-module", encoder_stages=True)
    return _settings_from_counts(plan.tp, [end - start for start, end in ranges])
