"""Read a ``bench/train_step.py`` JSON microbatch by microbatch: where do the methods' measured
times differ from what the cost model predicts, and why?

A simulated speed-up has three possible sources: balance (the pipeline waits less), less work
(the same samples cost less in one method's microbatches) and the measurement (one method
timed in a warmer or cooler GPU state). This script fits every measured microbatch of both
methods to the cost model's prediction (time = a x predicted + b, per module: the encoders'
forward + backward, the LLM's) and prints the residuals of each method:

- by iteration and by quarter of the order they were timed in (warm-up, drift);
- by fifth of predicted load, both methods pooled (a convex or concave cost: a method holding
  the extremes then pays more for the same work);
- with a squared term added to the fit (how much of the method difference convexity explains).

    python bench/train_step_residuals.py bench/results/gpu/train_step_h100_1280_gb512.json

The predicted costs are the run's own: its workload, seed, vision preset and text scale give
the same table and costs as ``train_step.py`` built (``per_sample_costs`` of its model spec).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step import _scaled_text, bench_spec  # noqa: E402

from entrain_data.cost_model import per_sample_costs  # noqa: E402
from entrain_data.workloads import synthesize  # noqa: E402

MODULES = (("encoder", ("encoder_fwd", "encoder_bwd")), ("llm", ("llm_fwd", "llm_bwd")))


def per_microbatch(result: dict) -> dict[str, dict[str, np.ndarray]]:
    """Per method, arrays over its microbatches (in timing order within the method): measured
    and predicted time per module, iteration."""
    c = result["config"]
    table = synthesize(c["workload"], c["global_batch"] * c["iterations"], c["seed"])
    audio = len(table.audio_seconds) > 0
    spec = bench_spec(
        c["tiny"], None, None, audio, None, c.get("vision_preset", "qwen2.5-vl-vision")
    )
    costs = per_sample_costs(_scaled_text(table, c["text_scale"]), spec)
    pred = {"encoder": costs.encoder_cost().sum(axis=1), "llm": costs.llm_cost()}
    out = {}
    for method, data in result["methods"].items():
        mbs = data["microbatches"]
        rows = {"encoder": "encoder_rows", "llm": "llm_rows"}
        f = {"iteration": np.array([mb["iteration"] for mb in mbs])}
        for mod, keys in MODULES:
            f[mod] = np.array([sum(mb[k] for k in keys) for mb in mbs])
            f[f"{mod}_pred"] = np.array([pred[mod][mb[rows[mod]]].sum() for mb in mbs])
        out[method] = f
    return out


def _ms(x: np.ndarray) -> float:
    """Mean in ms; nan for an empty group (a short run's fifth or quarter)."""
    return float(x.mean() * 1e3) if x.size else float("nan")


def report(result: dict) -> dict:
    """The residual tables (printed) as a dict: per module, per method."""
    per = per_microbatch(result)
    methods = list(per)
    out: dict = {}
    for mod, _ in MODULES:
        y = np.concatenate([per[m][mod] for m in methods])
        p = np.concatenate([per[m][f"{mod}_pred"] for m in methods])
        who = np.concatenate([np.full(len(per[m][mod]), i) for i, m in enumerate(methods)])
        lin = np.stack([p, np.ones_like(p)], 1)
        coef, *_ = np.linalg.lstsq(lin, y, rcond=None)
        r = y - lin @ coef
        quad = np.stack([p, np.ones_like(p), p**2], 1)
        coef2, *_ = np.linalg.lstsq(quad, y, rcond=None)
        r2 = y - quad @ coef2
        edges = np.quantile(p, [0.2, 0.4, 0.6, 0.8])
        fifth = np.searchsorted(edges, p, side="right")
        mod_out = {
            "fit": {"per_predicted": float(coef[0]), "constant_s": float(coef[1])},
            "residual_ms_by_fifth": [_ms(r[fifth == k]) for k in range(5)],
            "methods": {},
        }
        print(f"{mod}: time = {coef[0]:.4g} x predicted + {coef[1] * 1e3:.2f} ms")
        print(f"  residual by fifth of predicted load (ms): "
              f"{' / '.join(f'{v:+.1f}' for v in mod_out['residual_ms_by_fifth'])}")  # fmt: skip
        for i, m in enumerate(methods):
            sel = who == i
            res, its = r[sel], per[m]["iteration"]
            q = max(len(res) // 4, 1)
            d = {
                "measured_s": float(y[sel].sum()),
                "residual_ms": _ms(res),
                "residual_ms_with_square": _ms(r2[sel]),
                "residual_ms_by_iteration": [_ms(res[its == it]) for it in np.unique(its)],
                "residual_ms_by_quarter": [_ms(res[k * q : (k + 1) * q]) for k in range(4)],
                "share_of_fifths": [
                    float((who[fifth == k] == i).mean()) if (fifth == k).any() else float("nan")
                    for k in range(5)
                ],
            }
            mod_out["methods"][m] = d
            print(f"  {m:12s} measured {d['measured_s']:8.3f} s  residual {d['residual_ms']:+6.2f} ms"
                  f" ({d['residual_ms_with_square']:+6.2f} with a squared term)  by iteration "
                  f"{' / '.join(f'{v:+.1f}' for v in d['residual_ms_by_iteration'])}  by quarter "
                  f"{' / '.join(f'{v:+.1f}' for v in d['residual_ms_by_quarter'])}  share of fifths "
                  f"{' / '.join(f'{v:.2f}' for v in d['share_of_fifths'])}")  # fmt: skip
        out[mod] = mod_out
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path, help="a JSON written by bench/train_step.py")
    a = p.parse_args(argv)
    return report(json.loads(a.result.read_text()))


if __name__ == "__main__":
    main()
