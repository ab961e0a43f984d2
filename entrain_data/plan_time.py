"""The planner's model of time: compute speed-up, recomputation, point-to-point and data-parallel
communication for each sharding (stated so it can be checked and calibrated).

- stage compute: the cost model's seconds / (tp * 0.9 ** log2(tp));
- recomputation of a stage: its backward also repeats the forward (f + 2f -> 2f + 2f);
- point-to-point: each microbatch's activations (tokens x hidden x 2 bytes) cross every
  stage boundary forward and backward;
- data-parallel traffic of a stage's trainable weights W (bf16, over tp), ring collectives
  moving (dp - 1) / dp of the bytes per GPU:
  ``none``: one all-reduce of the gradients per iteration (2 x);
  ``optimizer`` / ``gradients``: one reduce-scatter of the gradients and one all-gather of the
  updated weights (the same 2 x; the adapters reduce once per iteration);
  ``full``: the weights are all-gathered for every microbatch's forward and again for its
  backward (FSDP / ZeRO-3 resharding after forward), overlapped with that microbatch's compute
  (prefetch; a microbatch lasts max(compute, gather)), plus one reduce-scatter per iteration.
  None of the per-iteration collectives is overlapped with compute.
- per-call overhead of a stage, per microbatch, forward and backward alike:
  ``OVERHEAD_PER_MICROBATCH`` (the pipeline schedule's step: launch, p2p handshake) plus the
  calibrated constant of every module segment it holds (:meth:`SampleCosts.call_overhead`,
  measured on whole-module calls, so not part of the fixed step cost); a recomputing stage
  pays its forward's again in backward (:func:`stage_overheads`);
- bandwidth per GPU: the cluster's ``intra_node_gbps`` when the group fits in one node, else
  ``inter_node_gbps`` (Cluster defaults: 450 GB/s NVLink, 50 GB/s = 400 Gb/s InfiniBand).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .plan import Cluster, StagePlan

if TYPE_CHECKING:
    from .cost_model import SampleCosts

__all__ = [
    "TP_EFFICIENCY",
    "RECOMPUTE_SLOWDOWN",
    "OVERHEAD_PER_MICROBATCH",
    "tp_speedup",
    "group_bandwidth",
    "sync_time",
    "gather_times",
    "stage_overheads",
]

TP_EFFICIENCY = 0.9  # compute efficiency kept per doubling of tensor parallelism
RECOMPUTE_SLOWDOWN = 4.0 / 3.0  # full recomputation repeats the forward (f + 2f -> 2f + 2f)
OVERHEAD_PER_MICROBATCH = 2e-4  # seconds of launch/scheduling per stage per microbatch


def tp_speedup(tp: int) -> float:
    return tp * TP_EFFICIENCY ** math.log2(tp)


def group_bandwidth(cluster: Cluster, span: int) -> float:
    """Bytes/s per GPU of a group spanning ``span`` consecutive GPUs."""
    gbps = cluster.intra_node_gbps if span <= cluster.gpus_per_node else cluster.inter_node_gbps
    return gbps * 1e9


def sync_time(
    params: list[tuple[float, float]], tp: int, dp: int, cluster: Cluster, sharding: str
) -> float:
    """Per-iteration DP collectives of the stage with the most trainable weights (seconds).

    ``params``: (trainable, frozen) parameters of every stage.
    """
    if dp == 1:
        return 0.0
    w = max(p[0] for p in params) * 2 / tp
    share = (dp - 1) / dp * w / group_bandwidth(cluster, tp * dp)
    return share if sharding == "full" else 2 * share  # full: the reduce-scatter only


def gather_times(
    params: list[tuple[float, float]], tp: int, dp: int, cluster: Cluster, sharding: str
) -> np.ndarray:
    """[S] seconds to all-gather each stage's weights once (0 unless ``sharding == "full"``);
    a microbatch's forward and its backward each need one."""
    if sharding != "full" or dp == 1:
        return np.zeros(len(params))
    bw = group_bandwidth(cluster, tp * dp)
    return np.array([(dp - 1) / dp * (t + f) * 2 / tp / bw for t, f in params])


def stage_overheads(
    costs: SampleCosts | None, stages: Sequence[StagePlan], recompute: Sequence[bool] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """([S] forward, [S] backward) fixed seconds every microbatch pays on each stage (see the
    module docstring); ``costs`` None: the fixed step cost alone."""
    f = np.full(len(stages), OVERHEAD_PER_MICROBATCH)
    b = f.copy()
    for s, st in enumerate(stages):
        for seg in st.segments if costs is not None else ():
            fs, bs = costs.call_overhead(seg.encoder_index, seg.layer_start, seg.layer_end)
            f[s] += fs
            b[s] += bs
    rc = np.asarray(list(recompute) or [False] * len(stages), dtype=bool)
    return f, b + np.where(rc, f - OVERHEAD_PER_MICROBATCH, 0.0)
