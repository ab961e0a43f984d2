"""Macro profiling: the workload of whole global batches, per module.

Entrain's static plan rests on concentration: a module's work summed over a
global batch of B samples varies far less than one sample's (its coefficient
of variation shrinks about as 1/sqrt(B)), so each module's share of the work
is nearly the same from one global batch to the next. :func:`macro_profile`
draws K seeded global batches, sums every module's training time over each,
and reports the spread, the encoder:LLM ratio and how the spread shrinks with
B next to the 1/sqrt(B) law (with the finite-population correction for
drawing without replacement). The drawn batches' sample indices are kept: the
planner scores candidate layouts on exactly these batches.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .calibration import Calibration
from .cost_model import Hardware, SampleCosts, per_sample_costs
from .errors import InvalidInput
from .metadata import SampleTable
from .presets import ModelSpec

__all__ = [
    "MacroProfile",
    "macro_profile",
    "module_costs",
    "format_seconds",
    "PROFILE_SCHEMA_VERSION",
]

log = logging.getLogger(__name__)

PROFILE_SCHEMA_VERSION = 1


def _cv(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """Coefficient of variation (sample std / mean; 0 where the mean is 0)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[axis] < 2:
        return np.zeros(np.delete(x.shape, axis))
    m = x.mean(axis=axis)
    s = x.std(axis=axis, ddof=1)
    return np.divide(s, m, out=np.zeros_like(m), where=m > 0)


def module_costs(costs: SampleCosts) -> np.ndarray:
    """[N, M] training seconds (forward + backward) of every module: encoders, then the LLM."""
    return np.concatenate([costs.encoder_cost(), costs.llm_cost()[:, None]], axis=1)


def format_seconds(seconds: float) -> str:
    """A duration with 4 significant digits in s, ms or us: the demo's tiny model spends
    microseconds per batch and a paper-scale one seconds; one fixed format hides one of them."""
    s = float(seconds)
    if abs(s) >= 1.0:
        return f"{s:.4g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} us"


@dataclass(frozen=True, eq=False)
class MacroProfile:
    """Per-module statistics of K global batches of B samples; JSON-serialisable.

    Arrays over modules follow ``module_names`` (encoders, then ``"llm"``).
    ``batch_sums[k, m]`` is module m's training seconds summed over batch k;
    ``batch_indices[k]`` the table rows of batch k.
    """

    module_names: tuple[str, ...]
    global_batch: int
    batches: int
    seed: int
    population: int
    batch_indices: np.ndarray  # [K, B] int64
    batch_sums: np.ndarray  # [K, M] seconds
    batch_llm_tokens: np.ndarray  # [K] int64
    sample_mean: np.ndarray  # [M]
    sample_cv: np.ndarray  # [M]
    ratio: np.ndarray  # [K] all encoders : LLM per batch
    scaling_sizes: tuple[int, ...]
    scaling_cv: np.ndarray  # [len(sizes), M] measured batch-sum CV
    scaling_ratio_cv: np.ndarray  # [len(sizes)]
    model: dict

    @property
    def mean(self) -> np.ndarray:
        """[M] mean batch-sum seconds."""
        return self.batch_sums.mean(axis=0)

    @property
    def cv(self) -> np.ndarray:
        """[M] batch-sum coefficient of variation."""
        return _cv(self.batch_sums)

    @property
    def ratio_mean(self) -> float:
        return float(self.ratio.mean())

    @property
    def ratio_cv(self) -> float:
        return float(_cv(self.ratio)) if len(self.ratio) > 1 else 0.0

    def law_cv(self, b: int | np.ndarray) -> np.ndarray:
        """Predicted batch-sum CV at batch size b: sample CV / sqrt(b), finite-population corrected."""
        b = np.asarray(b, dtype=np.float64)
        n = float(self.population)
        fpc = np.sqrt(np.clip((n - b) / max(n - 1.0, 1.0), 0.0, 1.0))
        return np.multiply.outer(1.0 / np.sqrt(b) * fpc, self.sample_cv)

    def share(self) -> np.ndarray:
        """[M] each module's mean share of the total work."""
        m = self.mean
        return m / m.sum() if m.sum() > 0 else m

    # ------------------------------------------------------------ serialise
    def to_dict(self, include_batches: bool = True) -> dict[str, Any]:
        """JSON-ready form of the profile."""
        d: dict[str, Any] = {
            "schema_version": PROFILE_SCHEMA_VERSION,
            "module_names": list(self.module_names),
            "global_batch": self.global_batch,
            "batches": self.batches,
            "seed": self.seed,
            "population": self.population,
            "batch_sums": self.batch_sums.tolist(),
            "batch_llm_tokens": self.batch_llm_tokens.tolist(),
            "sample_mean": self.sample_mean.tolist(),
            "sample_cv": self.sample_cv.tolist(),
            "ratio": self.ratio.tolist(),
            "scaling_sizes": list(self.scaling_sizes),
            "scaling_cv": self.scaling_cv.tolist(),
            "scaling_ratio_cv": self.scaling_ratio_cv.tolist(),
            "model": self.model,
            "summary": {
                "mean": self.mean.tolist(),
                "cv": self.cv.tolist(),
                "ratio_mean": self.ratio_mean,
                "ratio_cv": self.ratio_cv,
            },
        }
        if include_batches:
            d["batch_indices"] = self.batch_indices.tolist()
        return d

    def to_json(self, include_batches: bool = True) -> str:
        """The profile as indented JSON text."""
        return json.dumps(self.to_dict(include_batches))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MacroProfile:
        try:
            if int(d.get("schema_version", 0)) > PROFILE_SCHEMA_VERSION:
                raise InvalidInput(
                    f"profile schema version {d['schema_version']} is newer than {PROFILE_SCHEMA_VERSION}"
                )
            k, b = int(d["batches"]), int(d["global_batch"])
            idx = np.asarray(d.get("batch_indices", np.zeros((0, b))), dtype=np.int64).reshape(
                -1, b
            )
            return cls(
                module_names=tuple(d["module_names"]),
                global_batch=b,
                batches=k,
                seed=int(d["seed"]),
                population=int(d["population"]),
                batch_indices=idx,
                batch_sums=np.asarray(d["batch_sums"], dtype=np.float64).reshape(k, -1),
                batch_llm_tokens=np.asarray(d["batch_llm_tokens"], dtype=np.int64),
                sample_mean=np.asarray(d["sample_mean"], dtype=np.float64),
                sample_cv=np.asarray(d["sample_cv"], dtype=np.float64),
                ratio=np.asarray(d["ratio"], dtype=np.float64),
                scaling_sizes=tuple(int(x) for x in d["scaling_sizes"]),
                scaling_cv=np.asarray(d["scaling_cv"], dtype=np.float64).reshape(
                    len(d["scaling_sizes"]), -1
                ),
                scaling_ratio_cv=np.asarray(d["scaling_ratio_cv"], dtype=np.float64),
                model=dict(d.get("model", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidInput):
                raise
            raise InvalidInput(f"malformed macro profile: {exc}") from exc

    @classmethod
    def from_json(cls, s: str) -> MacroProfile:
        return cls.from_dict(json.loads(s))

    # ------------------------------------------------------------ present
    def format_table(self) -> str:
        """The profile as a plain-text table (what ``entrain-data profile`` prints)."""
        b = self.global_batch
        law = self.law_cv(b)
        w = max(12, *(len(n) for n in self.module_names))
        lines = [
            f"macro profile: {self.batches} global batches of {b} samples (population {self.population}, seed {self.seed})",
            f"{'module':<{w}}  {'mean/batch':>12}  {'share':>6}  {'batch CV':>9}  {'1/sqrt(B) law':>13}  {'sample CV':>9}",
        ]
        share = self.share()
        for m, name in enumerate(self.module_names):
            lines.append(
                f"{name:<{w}}  {format_seconds(self.mean[m]):>12}  {share[m]:6.1%}  {self.cv[m]:9.4f}  {law[m]:13.4f}  {self.sample_cv[m]:9.3f}"
            )
        if len(self.module_names) > 1:
            lines.append(
                f"{'encoder:LLM':<{w}}  {self.ratio_mean:12.4f}  {'':>6}  {self.ratio_cv:9.4f}"
            )
        lines.append(f"mean LLM tokens per batch: {self.batch_llm_tokens.mean():.0f}")
        if self.batches < 2:
            lines.append("note: batch CVs need at least 2 batches (--batches); shown as 0")
        lines.append("")
        lines.append("batch-sum CV vs B (measured / 1/sqrt(B) law):")
        head = f"{'B':>7}  " + "  ".join(f"{n[:18]:>18}" for n in self.module_names)
        if len(self.module_names) > 1:
            head += f"  {'encoder:LLM':>11}"
        lines.append(head)
        laws = self.law_cv(np.asarray(self.scaling_sizes))
        for i, s in enumerate(self.scaling_sizes):
            row = f"{s:>7}  " + "  ".join(
                f"{self.scaling_cv[i, m]:8.4f}/{laws[i, m]:<9.4f}"
                for m in range(len(self.module_names))
            )
            if len(self.module_names) > 1:
                row += f"  {self.scaling_ratio_cv[i]:11.4f}"
            lines.append(row)
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """PNG of batch-sum CV vs B per module against the 1/sqrt(B) law (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - matplotlib is in the bench extra
            raise InvalidInput(
                "--png needs matplotlib (pip install 'entrain-data[bench]')"
            ) from exc
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sizes = np.asarray(self.scaling_sizes, dtype=np.float64)
        laws = self.law_cv(sizes)
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for m, name in enumerate(self.module_names):
            (line,) = ax.loglog(sizes, self.scaling_cv[:, m], "o-", label=f"{name} (measured)")
            ax.loglog(
                sizes,
                laws[:, m],
                "--",
                color=line.get_color(),
                alpha=0.6,
                label=f"{name} (1/sqrt(B))",
            )
        if len(self.module_names) > 1:
            ax.loglog(sizes, self.scaling_ratio_cv, "s-", color="k", label="encoder:LLM ratio")
        ax.axvline(self.global_batch, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("global batch size B (samples)")
        ax.set_ylabel("coefficient of variation of batch-sum work")
        ax.set_title(f"macro profile, {self.batches} batches per B")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _draw(rng: np.random.Generator, n: int, b: int, k: int) -> np.ndarray:
    """K batches of b distinct rows each (without replacement inside a batch)."""
    out = np.empty((k, b), dtype=np.int64)
    for i in range(k):
        out[i] = rng.choice(n, size=b, replace=False) if b < n else rng.permutation(n)
    return out


def macro_profile(
    table: SampleTable,
    model: ModelSpec,
    global_batch: int,
    batches: int = 32,
    seed: int = 0,
    *,
    hardware: Hardware | None = None,
    calibration: Calibration | dict | None = None,
    costs: SampleCosts | None = None,
    scaling_sizes: tuple[int, ...] | None = None,
) -> MacroProfile:
    """Profile ``batches`` seeded global batches of ``global_batch`` samples drawn from ``table``.

    ``costs`` may be passed when already computed for ``table``. The CV-vs-B
    sweep uses powers of 4 up to (and including) ``global_batch``.
    """
    n = len(table)
    if not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise InvalidInput(f"global_batch must be a positive integer, got {global_batch!r}")
    if not isinstance(batches, (int, np.integer)) or batches < 1:
        raise InvalidInput(f"batches must be a positive integer, got {batches!r}")
    c = costs if costs is not None else per_sample_costs(table, model, hardware, calibration)
    if global_batch > n:
        raise InvalidInput(f"global_batch {global_batch} exceeds the {n} samples of {table.origin}")
    if len(c) != n:
        raise InvalidInput(f"costs cover {len(c)} samples but the table has {n}")
    work = module_costs(c)  # [N, M]
    n_enc = work.shape[1] - 1
    rng = np.random.default_rng(seed)
    idx = _draw(rng, n, global_batch, batches)
    sums = work[idx].sum(axis=1)  # [K, M]

    def ratio_of(s: np.ndarray) -> np.ndarray:
        enc = s[:, :n_enc].sum(axis=1)
        return np.divide(enc, s[:, -1], out=np.zeros(len(s)), where=s[:, -1] > 0)

    if scaling_sizes is None:
        sizes = sorted({4**i for i in range(12) if 4**i < global_batch} | {global_batch})
    else:
        sizes = sorted({int(s) for s in scaling_sizes if 1 <= int(s) <= n})
    srng = np.random.default_rng([seed, 1])
    s_cv = np.zeros((len(sizes), work.shape[1]))
    s_rcv = np.zeros(len(sizes))
    for i, s in enumerate(sizes):
        ss = sums if s == global_batch else work[_draw(srng, n, s, batches)].sum(axis=1)
        s_cv[i] = _cv(ss)
        s_rcv[i] = _cv(ratio_of(ss)) if n_enc and batches > 1 else 0.0
    log.info("profiled %d batches of %d from %d samples", batches, global_batch, n)
    return MacroProfile(
        module_names=model.module_names,
        global_batch=int(global_batch),
        batches=int(batches),
        seed=int(seed),
        population=n,
        batch_indices=idx,
        batch_sums=sums,
        batch_llm_tokens=c.llm_tokens[idx].sum(axis=1).astype(np.int64),
        sample_mean=work.mean(axis=0),
        sample_cv=_cv(work),
        ratio=ratio_of(sums) if n_enc else np.zeros(batches),
        scaling_sizes=tuple(sizes),
        scaling_cv=s_cv,
        scaling_ratio_cv=s_rcv,
        model=model.to_dict(),
    )
