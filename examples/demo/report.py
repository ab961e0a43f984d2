"""The demo's figures: calibration from measured forwards, per-method summaries, table, plot."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from entrain_data.cost_model import calibrate
from entrain_data.errors import EntrainError
from entrain_data.presets import ModelSpec
from entrain_data.simulator import simulate_pipeline

__all__ = ["measured", "calibrate_runs", "summarise", "table", "plot", "microbatch_figure"]

log = logging.getLogger(__name__)


def measured(runs: list[dict]) -> list[dict]:
    """Every rank's timed microbatches after its first (warm-up) iteration.

    The first forward of a process pays one-off costs (allocator growth, lazy
    kernel set-up) that say nothing about the microbatch; like any benchmark,
    the demo leaves that iteration out of its figures, for both methods alike.
    """
    out = []
    for r in runs:
        mbs = r["microbatches"]
        if not mbs:
            continue
        first = min((m["epoch"], m["iteration"]) for m in mbs)
        out.extend(m for m in mbs if (m["epoch"], m["iteration"]) != first)
    return out


def calibrate_runs(table, spec: ModelSpec, runs: list[dict], key_row: dict[str, int]):
    """Least-squares fit of every module's forward time to this run's per-microbatch timings."""
    mbs = measured(runs)
    cal = None
    fits = {}
    for module, field, keys in (
        (spec.encoders[0].name, "vision_fwd", "encoder_keys"),
        (spec.encoders[1].name, "audio_fwd", "encoder_keys"),
        ("llm", "llm_fwd", "llm_keys"),
    ):
        used = [m for m in mbs if m[keys] and m[field] > 0]
        if len(used) < 4:
            continue
        groups = [np.array([key_row[k] for k in m[keys]]) for m in used]
        cal = calibrate(table, spec, module, groups, [m[field] for m in used], previous=cal)
        fits[module] = cal.get(module)
    if cal is None:
        raise EntrainError("demo: the sequential run recorded too few microbatches to calibrate")
    return cal, fits


def _cv(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.std() / x.mean()) if len(x) and x.mean() > 0 else 0.0


def summarise(method: str, runs: list[dict], costs, key_row: dict[str, int]) -> dict[str, Any]:
    """Per-microbatch load CVs (measured and cost model) and step times of one method."""
    mbs = measured(runs)
    enc_model = costs.encoder_cost().sum(axis=1)
    llm_model = costs.llm_cost()

    def modelled(keys, arr):
        return float(arr[[key_row[k] for k in keys]].sum()) if keys else 0.0

    enc_m = np.array([modelled(m["encoder_keys"], enc_model) for m in mbs])
    llm_m = np.array([modelled(m["llm_keys"], llm_model) for m in mbs])
    # measured step: the slower rank of each iteration (DP ranks wait for each other)
    by_step: dict[tuple, float] = {}
    for r in runs:
        for s in r["steps"]:
            k = (s["epoch"], s["iteration"])
            by_step[k] = max(by_step.get(k, 0.0), s["seconds"])
    # simulated step: the cost model's per-microbatch times through the pipeline simulator
    sims = []
    groups: dict[tuple, list[dict]] = {}
    for m in mbs:
        groups.setdefault((m["epoch"], m["iteration"]), []).append(m)
    for items in groups.values():
        reps = sorted({m["replica"] for m in items})
        n_mb = max(m["microbatch"] for m in items) + 1
        fwd = np.zeros((len(reps), n_mb, 1))
        for m in items:
            fwd[reps.index(m["replica"]), m["microbatch"], 0] = modelled(
                m["encoder_keys"], enc_model
            ) + modelled(m["llm_keys"], llm_model)
        sims.append(simulate_pipeline(fwd / 3.0, fwd * 2.0 / 3.0).iteration_time)  # bwd = 2 fwd
    steps = np.array(sorted(by_step.values()))
    return {
        "method": method,
        "microbatches": len(mbs),
        "encoder_cv_measured": _cv([m["encoder_fwd"] for m in mbs]),
        "llm_cv_measured": _cv([m["llm_fwd"] for m in mbs]),
        "encoder_cv_model": _cv(enc_m),
        "llm_cv_model": _cv(llm_m),
        "step_seconds_measured": float(np.median(steps[1:] if len(steps) > 2 else steps)),
        "step_seconds_simulated": float(np.mean(sims)),
        "steps": len(steps),
        "final_loss": float(np.mean([r["steps"][-1]["loss"] for r in runs if r["steps"]])),
        "series": {
            "encoder_fwd": [m["encoder_fwd"] for m in sorted(mbs, key=_order)],
            "llm_fwd": [m["llm_fwd"] for m in sorted(mbs, key=_order)],
            "iteration": [[m["epoch"], m["iteration"]] for m in sorted(mbs, key=_order)],
        },
    }


def _order(m: dict) -> tuple:
    return (m["epoch"], m["iteration"], m["replica"], m["microbatch"])


def table(rows: list[dict]) -> str:
    head = (
        f"{'method':<11} {'enc CV meas':>11} {'LLM CV meas':>11} {'enc CV model':>12} "
        f"{'LLM CV model':>12} {'step meas s':>11} {'step sim s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['method']:<11} {r['encoder_cv_measured']:>11.3f} {r['llm_cv_measured']:>11.3f} "
            f"{r['encoder_cv_model']:>12.3f} {r['llm_cv_model']:>12.3f} "
            f"{r['step_seconds_measured']:>11.3f} {r['step_seconds_simulated']:>10.3f}"
        )
    seq, ent = rows
    lines.append(
        f"entrain vs sequential: encoder CV {seq['encoder_cv_measured'] / max(ent['encoder_cv_measured'], 1e-12):.2f}x lower, "
        f"LLM CV {seq['llm_cv_measured'] / max(ent['llm_cv_measured'], 1e-12):.2f}x lower (measured); "
        f"step {seq['step_seconds_measured'] / ent['step_seconds_measured']:.2f}x (measured), "
        f"{seq['step_seconds_simulated'] / ent['step_seconds_simulated']:.2f}x (simulated)"
    )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is not installed: the table is the result
        log.warning("matplotlib not installed; no plot written")
        return None
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for ax, key, title in (
        (axes[0], "encoder_fwd", "encoder forward"),
        (axes[1], "llm_fwd", "LLM forward"),
    ):
        for r in rows:
            ax.plot(np.array(r["series"][key]) * 1e3, label=r["method"], lw=1)
        its = rows[0]["series"]["iteration"]
        for x in range(1, len(its)):
            if its[x] != its[x - 1]:
                ax.axvline(x - 0.5, color="grey", ls=":", lw=0.8)
        ax.set_ylabel("ms")
        ax.set_title(f"per-microbatch {title} time (both ranks, in order)")
        ax.legend()
    axes[1].set_xlabel("microbatch (dotted lines: iteration boundaries)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def microbatch_figure(
    seq_runs: list[dict], ent_runs: list[dict], iterations: int = 2, width: int = 26
) -> str:
    """Rank 0's LLM forward time of every microbatch in its first measured iterations, the two
    methods side by side as text bars: the README's figure is a copy of what this prints."""

    def rows(runs: list[dict]) -> list[tuple[int, int, float]]:
        mbs = sorted(measured(runs[:1]), key=_order)
        its = sorted({(m["epoch"], m["iteration"]) for m in mbs})[:iterations]
        return [
            (its.index((m["epoch"], m["iteration"])) + 1, m["microbatch"], m["llm_fwd"] * 1e3)
            for m in mbs
            if (m["epoch"], m["iteration"]) in its
        ]

    seq, ent = rows(seq_runs), rows(ent_runs)
    top = max([ms for *_, ms in seq + ent], default=0.0)
    if not seq or not ent or top <= 0:
        return "(too few measured microbatches for the per-microbatch figure)"
    per_mark = top / width
    lines = [
        f"LLM forward time of rank 0's microbatches (CPU ms; one # is {per_mark:.1f} ms)",
        f"{'':12}{'sequential':<{width + 15}}entrain",
    ]
    for i, (s, e) in enumerate(zip(seq, ent)):
        label = f"iteration {s[0]}" if i == 0 or seq[i - 1][0] != s[0] else ""
        bars = [
            f"mb {m:<2}{'#' * round(ms / per_mark):<{width}} {ms:5.0f}   " for _, m, ms in (s, e)
        ]
        lines.append(f"{label:<12}{bars[0]}{bars[1]}".rstrip())
    return "\n".join(lines)
