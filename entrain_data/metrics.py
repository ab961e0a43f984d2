"""Balance metrics of an assignment: per-microbatch loads and their coefficient of variation.

The paper's headline figure is the variability of per-microbatch work on each
module (vision forward std 208 -> 19.6 ms); these functions compute it from an
assignment and per-sample costs so every method is measured the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .assignment import Assignment
from .errors import InvalidInput

__all__ = ["MicrobatchLoads", "microbatch_loads", "load_cv", "stage_cv", "sets_sum"]


def sets_sum(sets: Sequence[Sequence[np.ndarray]], per_sample: np.ndarray) -> np.ndarray:
    """Sum ``per_sample`` ([N] or [N, K]) over every ``sets[r][j]``: [R, M] or [R, M, K].

    Prefix sums over the sets laid end to end, so the cost is one pass over the
    samples whatever the number of sets (empty sets sum to 0).
    """
    per_sample = np.asarray(per_sample, dtype=np.float64)
    r_count = len(sets)
    m = len(sets[0]) if r_count else 0
    flat = [np.asarray(s, dtype=np.int64) for row in sets for s in row]
    lens = np.fromiter((len(s) for s in flat), dtype=np.int64, count=len(flat))
    idx = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    prefix = np.zeros((len(idx) + 1,) + per_sample.shape[1:])
    np.cumsum(per_sample[idx], axis=0, out=prefix[1:])
    ends = np.cumsum(lens)
    return (prefix[ends] - prefix[ends - lens]).reshape((r_count, m) + per_sample.shape[1:])


@dataclass(frozen=True)
class MicrobatchLoads:
    """Work of every (replica, microbatch): encoders from the E sets, the LLM from the L sets."""

    encoder: np.ndarray  # [R, M] all encoder columns summed
    encoder_by_module: np.ndarray  # [R, M, E]
    llm: np.ndarray  # [R, M]

    def cv(self) -> dict[str, float]:
        """CV of the per-microbatch load of the encoders (together), each encoder, and the LLM."""
        out = {"encoder": load_cv(self.encoder), "llm": load_cv(self.llm)}
        if self.encoder_by_module.shape[-1] > 1:
            for e in range(self.encoder_by_module.shape[-1]):
                out[f"encoder{e}"] = load_cv(self.encoder_by_module[..., e])
        return out


def microbatch_loads(
    assignment: Assignment, encoder_cost: np.ndarray, llm_cost: np.ndarray
) -> MicrobatchLoads:
    """Per-(replica, microbatch) loads of ``assignment`` under per-sample costs.

    ``encoder_cost`` is [N] or [N, E], ``llm_cost`` [N], indexed like the
    assignment's sample indices. Carried samples count nowhere.
    """
    enc = np.asarray(encoder_cost, dtype=np.float64)
    llm = np.asarray(llm_cost, dtype=np.float64)
    if enc.ndim == 1:
        enc = enc[:, None]
    if enc.ndim != 2 or llm.ndim != 1 or len(enc) != len(llm):
        raise InvalidInput(
            f"microbatch_loads: encoder_cost [N] or [N, E] and llm_cost [N] expected, got "
            f"{np.shape(encoder_cost)} and {np.shape(llm_cost)}"
        )
    by_module = sets_sum(assignment.encoder_sets, enc)
    return MicrobatchLoads(by_module.sum(axis=-1), by_module, sets_sum(assignment.llm_sets, llm))


def load_cv(loads: np.ndarray) -> float:
    """Coefficient of variation (population std / mean) over all entries; 0 for zero load."""
    x = np.asarray(loads, dtype=np.float64).ravel()
    if x.size == 0:
        raise InvalidInput("load_cv: no loads given")
    mean = float(x.mean())
    return float(x.std() / mean) if mean > 0 else 0.0


def stage_cv(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """[S] CV of per-microbatch (forward + backward) time on each pipeline stage.

    ``fwd``/``bwd`` are the simulator's [R, M, S] stage times; the CV runs over
    all replicas and microbatches of a stage.
    """
    f = np.asarray(fwd, dtype=np.float64)
    b = np.asarray(bwd, dtype=np.float64)
    if f.ndim != 3 or f.shape != b.shape:
        raise InvalidInput(
            f"stage_cv: fwd and bwd must both be [R, M, S], got {f.shape}, {b.shape}"
        )
    t = (f + b).reshape(-1, f.shape[2])
    mean = t.mean(axis=0)
    return np.where(mean > 0, t.std(axis=0) / np.where(mean > 0, mean, 1.0), 0.0)
