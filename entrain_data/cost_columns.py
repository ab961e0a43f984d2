"""The loader service's encoder cost columns: which encoders ``assign`` balances as one.

Encoders whose work lies on the pipeline stages in the same proportions (equal columns of the
plan's ``stage_shares``) and that are frozen alike are summed into one column: the summed
column prices them exactly (every stage holds the same share of each), and balancing the sum
weighs each encoder by its cost. Encoders laid out differently (a vision tower on the first
stage, an audio tower split over the next two) keep a column each, so entrain's proxy sees on
which stage a sample's work lands: on the planner's two-encoder layouts that keep them
apart, the service's stream ran 1.013-1.084x faster than with one summed column
(``bench/cost_columns.py``, bench/RESULTS.md, twenty-fifth session).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import InvalidInput

__all__ = ["share_columns", "group_columns", "column_shares"]

_SAME = 1e-9  # shares closer than this are the same layout


def share_columns(shares: np.ndarray, frozen: Sequence[bool] | None = None) -> list[list[int]]:
    """Encoders (ascending, disjoint groups) with equal stage shares and equal ``frozen``
    flags, from ``shares`` [S, E + 1] (each encoder's share of every stage, then the LLM's)."""
    sh = np.asarray(shares, dtype=np.float64)
    e = sh.shape[1] - 1
    flags = [False] * e if frozen is None else [bool(f) for f in frozen]
    if len(flags) != e:
        raise InvalidInput(f"share_columns: {len(flags)} frozen flags for {e} encoders")
    groups: list[list[int]] = []
    for i in range(e):
        same = (
            g
            for g in groups
            if flags[g[0]] == flags[i] and np.allclose(sh[:, g[0]], sh[:, i], rtol=0, atol=_SAME)
        )
        g = next(same, None)
        if g is None:
            groups.append([i])
        else:
            g.append(i)
    return groups


def group_columns(encoder_cost: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """[N, E] per-encoder values (costs, patches) -> [N, G], each group's columns summed."""
    enc = np.asarray(encoder_cost)
    enc = enc[:, None] if enc.ndim == 1 else enc
    if sum(len(g) for g in groups) != enc.shape[1]:
        raise InvalidInput(
            f"cost columns {groups} name other encoders than the {enc.shape[1]} given"
        )
    if not groups:
        return enc[:, :0]
    return np.stack([enc[:, g].sum(axis=1) for g in groups], axis=1)


def column_shares(shares: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """[S, E + 1] per-encoder stage shares -> [S, G + 1], one column per group (its members'
    shares are equal) and the LLM's: what ``assign(stage_shares=)`` takes beside the summed
    costs."""
    sh = np.asarray(shares, dtype=np.float64)
    return np.column_stack([sh[:, g[0]] for g in groups] + [sh[:, -1]])
