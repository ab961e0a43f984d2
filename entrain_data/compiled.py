"""numba, when installed: the switch for the compiled twins of the assignment's hot loops.

The assignment's inner loops (the pipeline search's rounds, the greedy set builders)
run over a few hundred elements at a time, where numpy's per-call cost, not arithmetic,
is the time. Their compiled twins (:mod:`.assignment.search_kernel`,
:mod:`.assignment.fluid_kernel`, :mod:`.assignment.order_kernel`,
:mod:`.assignment.sets_kernel`, :mod:`.assignment.split_kernel`) loop element by element
and return exactly what the numpy code returns (same draws, same order of every float
operation, the same tie-breaks); ``tests/test_compiled.py`` compares the two.

numba is optional (``pip install entrain-data[fast]``): without it, or with
``ENTRAIN_NUMBA=0`` in the environment, :func:`enabled` is false and every caller runs
its numpy code. Compiled code is cached on disk by numba, so only the first process on a
machine pays the compile time (about 15 s on a 2-core machine).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from functools import cache

__all__ = ["enabled", "jit"]


def jit(fn=None, *, inline: bool = False):
    """``fn`` compiled by numba, its machine code cached on disk. Only the twin modules use
    it, and they are imported only when :func:`enabled`: numba's import costs ~0.4 s, paid
    by the first assignment (or multi-replica simulation) of a process, not by every import.
    ``@jit(inline=True)``: compiled into each caller (numba's inlining): called once per
    batch of simulated runs, as a function it cost the light work's probes a quarter of
    their time."""
    import numba

    compile_ = numba.njit(cache=True, nogil=True, inline="always" if inline else "never")
    return compile_ if fn is None else compile_(fn)


def enabled() -> bool:
    """Whether callers should use the compiled twins (numba installed, not switched off)."""
    return os.environ.get("ENTRAIN_NUMBA", "1") != "0" and _installed()


@cache
def _installed() -> bool:
    """numba importable here: a numba built for another numpy fails at import, and then the
    numpy code runs (with one warning) instead of every assignment failing."""
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        import numba  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means: run the numpy code
        warnings.warn(
            f"numba is installed but cannot be imported ({exc}); using numpy", stacklevel=3
        )
        return False
    return True
