"""Least-squares calibration of the cost model's coefficients to measured times.

The analytic model predicts, per module, a linear-term time (matmuls, linear in
tokens) and an attention-term time (quadratic in each attended sequence) on a
reference GPU. Real kernels reach different fractions of peak for the two, and
every call pays a fixed overhead (launches, communication), so measured times
are fitted as ``seconds = linear * x_linear + quadratic * x_attention + constant``.
The fit is saved with the plan (``to_dict``) and re-applied by
``per_sample_costs(..., calibration=...)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidInput

__all__ = ["ModuleFit", "Calibration", "fit_coefficients"]


@dataclass(frozen=True)
class ModuleFit:
    """Fitted scales of one module and how well they fit.

    ``constant`` is seconds per measured call (one forward, or one step, of a
    microbatch through the whole module), not per sample; the planner charges it to every
    microbatch on the stages holding the module, by their share of its layers
    (:func:`~entrain_data.plan_time.stage_overheads`).
    """

    linear: float = 1.0
    quadratic: float = 1.0
    constant: float = 0.0
    rel_rms: float = 0.0  # sqrt(mean(((pred - y) / y)^2))
    r2: float = 1.0
    n: int = 0
    phase: str = "forward"

    def __post_init__(self) -> None:
        for f in ("linear", "quadratic", "constant"):
            v = getattr(self, f)
            if not np.isfinite(v) or v < 0:
                raise InvalidInput(f"calibration: field {f!r} must be finite and >= 0, got {v}")
        if self.phase not in ("forward", "step"):
            raise InvalidInput(
                f"calibration: field 'phase' must be 'forward' or 'step', got {self.phase!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (saved with the plan)."""
        return {
            k: getattr(self, k)
            for k in ("linear", "quadratic", "constant", "rel_rms", "r2", "n", "phase")
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModuleFit:
        try:
            return cls(
                linear=float(d.get("linear", 1.0)),
                quadratic=float(d.get("quadratic", 1.0)),
                constant=float(d.get("constant", 0.0)),
                rel_rms=float(d.get("rel_rms", 0.0)),
                r2=float(d.get("r2", 1.0)),
                n=int(d.get("n", 0)),
                phase=str(d.get("phase", "forward")),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise InvalidInput(f"calibration: malformed module fit {d!r}") from exc


@dataclass(frozen=True)
class Calibration:
    """Per-module fits keyed by module name (encoder names, ``"llm"``); JSON-serialisable."""

    modules: dict[str, ModuleFit] = field(default_factory=dict)
    hardware: str = ""

    def get(self, name: str) -> ModuleFit | None:
        """The fit of module ``name`` (an encoder's name or ``"llm"``), None when not calibrated."""
        return self.modules.get(name)

    def merged(self, other: Calibration) -> Calibration:
        """This calibration with ``other``'s modules added or replaced."""
        return Calibration(
            modules={**self.modules, **other.modules}, hardware=other.hardware or self.hardware
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; :meth:`from_dict` reads it back."""
        return {
            "hardware": self.hardware,
            "modules": {k: v.to_dict() for k, v in self.modules.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Calibration:
        if d is None:
            return cls()
        if not isinstance(d, dict) or not isinstance(d.get("modules", {}), dict):
            raise InvalidInput("calibration: expected an object with a 'modules' mapping")
        return cls(
            modules={str(k): ModuleFit.from_dict(v) for k, v in d.get("modules", {}).items()},
            hardware=str(d.get("hardware", "")),
        )


def fit_coefficients(
    x_linear: np.ndarray, x_attention: np.ndarray, seconds: np.ndarray, phase: str = "forward"
) -> ModuleFit:
    """Non-negative least squares of ``seconds ~ a * x_linear + b * x_attention + c``.

    Solved by enumerating the active sets of the three coefficients (ordinary
    ``lstsq`` on each subset, keep the best non-negative one): exact for three
    unknowns, and needs only numpy.
    """
    xl = np.asarray(x_linear, dtype=np.float64)
    xa = np.asarray(x_attention, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if not (xl.shape == xa.shape == y.shape) or xl.ndim != 1:
        raise InvalidInput(
            "calibrate: features and measured seconds must be 1-D arrays of the same length"
        )
    if len(y) < 2:
        raise InvalidInput(f"calibrate: need at least 2 measurements, got {len(y)}")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise InvalidInput("calibrate: measured seconds must be finite and > 0")
    cols = [xl, xa, np.ones_like(y)]
    # a feature that is zero in every measurement says nothing: keep its analytic scale (1.0)
    informative = [i for i in range(3) if i == 2 or np.any(cols[i] != 0)]
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, len(informative) + 1):
        for subset in itertools.combinations(informative, k):
            a = np.stack([cols[i] for i in subset], axis=1)
            if np.linalg.matrix_rank(a) < k:
                continue
            coef, *_ = np.linalg.lstsq(a, y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(3)
            full[list(subset)] = coef
            sse = float(np.sum((np.stack(cols, axis=1) @ full - y) ** 2))
            if best is None or sse < best[0] - 1e-15 * max(1.0, best[0]):
                best = (sse, full)
    if best is None:  # pragma: no cover - a positive y always admits the constant-only fit
        raise InvalidInput("calibrate: no non-negative fit exists")
    coef = best[1]
    for i in (0, 1):
        if i not in informative:
            coef[i] = 1.0
    pred = np.stack(cols, axis=1) @ coef
    rel_rms = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - best[0] / ss_tot if ss_tot > 0 else 1.0
    return ModuleFit(
        linear=float(coef[0]),
        quadratic=float(coef[1]),
        constant=float(coef[2]),
        rel_rms=rel_rms,
        r2=float(r2),
        n=len(y),
        phase=phase,
    )
