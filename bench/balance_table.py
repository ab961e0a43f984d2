"""Markdown table of a ``bench/balance.py`` result, as bench/RESULTS.md shows it.

    python bench/balance_table.py bench/results/balance-paper.json

One row per workload and model: CVs of per-microbatch load (entrain / ``sequential``), entrain's
T/ideal, the whole-sample bound, entrain's throughput over the best peer that keeps samples in
their iteration, ``entrain_d2`` (``max_delay=2``) over the best peer, and the largest LLM set
(tokens) and encoder set (patches), entrain / ``sequential``. Then the summary lines the issue's
claims are read from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def render(result: dict) -> str:
    """The table and the summary of one balance.py JSON result."""
    head = (
        "| workload | model | enc CV | LLM CV | T/ideal | bound: sample / LPT | vs best keeping "
        "peer | max_delay=2 vs best peer | max LLM tokens | max patches |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines, keep, d2, cv_bad, slow = [head], [], [], [], []
    for row in result["results"]:
        e, s, d = (row["methods"][k] for k in ("entrain", "sequential", "entrain_d2"))
        name = f"{row['workload']}/{row['model']}"
        b = row["bound"]
        lines.append(
            f"| {row['workload']} | {row['model']} | {e['cv_encoder']:.4f} / {s['cv_encoder']:.3f} "
            f"| {e['cv_llm']:.4f} / {s['cv_llm']:.3f} | {e['ratio_to_ideal']:.3f} "
            f"| {b['max_sample_over_mean_mb']:.2f} / {b['lpt_bound']:.2f} "
            f"| {e['speedup_vs_best_keeping_peer']:.3f} ({row['best_keeping_peer']}) "
            f"| {d['speedup_vs_best_peer']:.3f} ({row['best_peer']}) "
            f"| {e['max_mb_tokens']} / {s['max_mb_tokens']} "
            f"| {e['max_mb_patches']} / {s['max_mb_patches']} |"
        )
        keep.append((name, e["speedup_vs_best_keeping_peer"]))
        d2.append((name, d["speedup_vs_best_peer"]))
        for k in ("cv_encoder", "cv_llm"):
            if e[k] >= s[k] and s[k] > 0:
                cv_bad.append(f"{name} {k} {e[k]:.4f} vs {s[k]:.4f}")
        for k in ("max_mb_tokens", "max_mb_patches"):
            if e[k] > s[k]:
                cv_bad.append(f"{name} {k} {e[k]} vs {s[k]}")
        if e["iterations_uncapped"]:
            cv_bad.append(f"{name} ran {e['iterations_uncapped']} iteration(s) without the caps")
        if e["ratio_to_ideal"] > 1.03:
            slow.append(f"{name} {e['ratio_to_ideal']:.3f} (LPT {b['lpt_bound']:.2f})")

    def summary(pairs):
        v = np.array([x for _, x in pairs])
        below = [f"{n} {x:.4f}" for n, x in pairs if round(x, 4) < 1.0]
        return f"min {v.min():.3f}, mean {v.mean():.3f}; below 1.000: {', '.join(below) or 'none'}"

    lines += [
        "",
        f"Over the {len(keep)} rows: entrain vs the best keeping peer {summary(keep)}. "
        f"`max_delay=2` vs the best peer {summary(d2)}.",
        f"CVs not below, or largest microbatch above, `sequential`'s: {'; '.join(cv_bad) or 'none'}.",
        f"T/ideal above 1.03: {'; '.join(slow) or 'none'}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(render(json.loads(Path(path).read_text())))
