"""The report of ``bench/train_step.py``: per-method statistics, fits and the printed table.

Kept apart from the measuring loop so each file reads on its own.
"""

from __future__ import annotations

import numpy as np
import torch

from entrain_data.assignment.pipeline_search import proxy_stage_shares
from entrain_data.calibration import Calibration
from entrain_data.cost_model import calibrate
from entrain_data.simulator import ideal_iteration_time, lower_bound, simulate_pipeline

MEASURES = ("encoder_fwd", "encoder_bwd", "llm_fwd", "llm_bwd")


def _stats(x: np.ndarray) -> dict[str, float]:
    mean = float(x.mean())
    std = float(x.std())
    return {"mean_ms": mean * 1e3, "std_ms": std * 1e3, "cv": std / mean if mean > 0 else 0.0}


def _fit(table, spec, module, groups, seconds, phase) -> dict:
    keep = [i for i, s in enumerate(seconds) if s > 0 and len(groups[i])]
    if len(keep) < 2:
        return {"error": "fewer than 2 non-empty measurements"}
    fit = calibrate(
        table, spec, module, [groups[i] for i in keep], [seconds[i] for i in keep], phase=phase
    ).get("llm" if module == "llm" else module)
    return fit.to_dict()


def _module_times(x: dict, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A microbatch's measured forward and backward per module (encoders in order, then
    the LLM); an encoder's backward is the one that runs with this LLM set (``bwd_arrival``)."""
    enc = x["per_encoder"]
    fwd = np.array([enc[n]["fwd"] for n in names] + [x["llm_fwd"]])
    bwd = np.array([enc[n]["bwd_arrival"] for n in names] + [x["llm_bwd"]])
    return fwd, bwd


def _llm_shares(k: int, encoders: int) -> np.ndarray:
    """[1 + k, modules] 1 encoder stage with every encoder, then K LLM stages with an even
    share of the LLM each."""
    shares = np.zeros((1 + k, encoders + 1))
    shares[0, :encoders] = 1.0
    shares[1:, -1] = 1.0 / k
    return shares


def _stage_times(rec: list[dict], it: int, dp: int, m: int, shares, names) -> tuple:
    """[dp, m, stages] forward and backward times of iteration ``it``'s microbatches, stage s
    doing ``shares[s, k]`` of module k's measured work (shares [stages, modules])."""
    fwd, bwd = np.zeros((dp, m, len(shares))), np.zeros((dp, m, len(shares)))
    for x in rec:
        if x["iteration"] == it:
            f, b = _module_times(x, names)
            fwd[x["replica"], x["microbatch"]] = shares @ f
            bwd[x["replica"], x["microbatch"]] = shares @ b
    return fwd, bwd


def report(a, spec, table, methods, per, params, device, plan_shares=None) -> dict:
    out: dict = {
        "config": {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__,
            "tiny": a.tiny,
            "workload": a.workload,
            "vision_preset": a.vision_preset,
            "global_batch": a.global_batch,
            "dp": a.dp,
            "microbatches": a.microbatches,
            "iterations": a.iterations,
            "warmup": a.warmup,
            "repeats": a.repeats,
            "max_tokens": a.max_tokens,
            "defer_budget": a.defer_budget,
            "text_scale": a.text_scale,
            "dtype": a.dtype,
            "recompute": a.recompute,
            "seed": a.seed,
            "pp": a.pp,
            "layout": a.layout,
            "plan_shares": None if plan_shares is None else np.asarray(plan_shares).tolist(),
            "methods": methods,
        },  # fmt: skip
        "model": {"spec": spec.to_dict(), "parameters": params},
        "methods": {},
    }
    for m in methods:
        rec = per[m]
        out["methods"][m] = {
            k: _stats(np.array([x[k] for x in rec])) for k in MEASURES + ("encoder_bwd_arrival",)
        }
        out["methods"][m]["per_encoder"] = {
            c.name: {
                k: _stats(np.array([x["per_encoder"][c.name][k] for x in rec]))
                for k in ("fwd", "bwd", "bwd_arrival")
            }
            for c in spec.encoders
        }
        out["methods"][m]["microbatches"] = rec
    if "sequential" in methods:
        out["std_ratio_vs_sequential"] = {
            m: {
                k: out["methods"]["sequential"][k]["std_ms"] / out["methods"][m][k]["std_ms"]
                if out["methods"][m][k]["std_ms"] > 0
                else None
                for k in MEASURES
            }
            for m in methods
            if m != "sequential"
        }
    # calibration on every measured microbatch of every method
    allrec = [x for m in methods for x in per[m]]
    cal: dict = {}
    series = [
        (c.name, "encoder_rows", [x["per_encoder"][c.name] for x in allrec]) for c in spec.encoders
    ] + [("llm", "llm_rows", [{"fwd": x["llm_fwd"], "bwd": x["llm_bwd"]} for x in allrec])]
    for module, rows_key, times in series:
        groups = [x[rows_key] for x in allrec]
        fwd = [t["fwd"] for t in times]
        step = [t["fwd"] + t["bwd"] for t in times]
        cal[module] = {
            "forward": _fit(table, spec, module, groups, fwd, "forward"),
            "step": _fit(table, spec, module, groups, step, "step"),
        }
    out["calibration"] = cal
    # the step fits, in the form `entrain-data profile/plan --calibration` reads
    step_fits = {m: d["step"] for m, d in cal.items() if "error" not in d["step"]}
    out["calibration_file"] = Calibration.from_dict(
        {"hardware": f"measured:{out['config']['gpu'] or device}", "modules": step_fits}
    ).to_dict()
    # pipeline simulation: 1 encoder stage + K LLM stages (LLM times split evenly)
    names = [c.name for c in spec.encoders]
    layouts = {
        str(k): _llm_shares(k, len(names))
        for k in (int(s) for s in a.llm_stages.split(",") if s.strip())
    }
    if a.pp:  # the told depth, the modules laid over the stages as entrain's proxy lays them
        totals = sum(np.add(*_module_times(x, names)) for x in allrec)
        layouts[f"pp{a.pp}"] = proxy_stage_shares(totals, a.pp)
    if plan_shares is not None:  # the plan's layer ranges (--layout plan), told to entrain
        layouts[f"plan{a.pp}"] = np.asarray(plan_shares)
    sim: dict = {}
    for key, shares in layouts.items():
        sim[key] = {}
        for m in methods:
            times, ideals, bounds = [], [], []
            for it in range(a.iterations):
                fwd, bwd = _stage_times(per[m], it, a.dp, a.microbatches, shares, names)
                times.append(simulate_pipeline(fwd, bwd, "1f1b").iteration_time)
                ideals.append(ideal_iteration_time(fwd, bwd, "1f1b"))
                bounds.append(lower_bound(fwd, bwd))
            sim[key][m] = {
                "iteration_time_s": float(np.mean(times)),
                "per_iteration_s": [float(t) for t in times],
                "ideal_s": float(np.mean(ideals)),
                "lower_bound_s": float(np.mean(bounds)),
            }
        if "sequential" in methods:
            base = sim[key]["sequential"]["iteration_time_s"]
            for m in methods:
                t = sim[key][m]["iteration_time_s"]
                sim[key][m]["speedup_vs_sequential"] = base / t if t > 0 else None
    out["simulation"] = sim
    return out


def print_table(res: dict) -> None:
    c = res["config"]
    print(
        f"\ntrain_step: {c['workload']} on {c['gpu'] or c['device']}, model "
        f"{res['model']['spec']['name']} ("
        + " + ".join(f"{v / 1e6:.1f}M" for v in res["model"]["parameters"].values())
        + f"), gb {c['global_batch']}, dp {c['dp']}, "
        f"{c['microbatches']} microbatches, {c['iterations']} iteration(s)"
    )
    hdr = f"{'method':<22}" + "".join(f"{k + ' mean/std ms':>26}" for k in MEASURES)
    print(hdr)
    for m, s in res["methods"].items():
        cells = "".join(f"{s[k]['mean_ms']:>15.2f} /{s[k]['std_ms']:>9.2f}" for k in MEASURES)
        print(f"{m:<22}{cells}")
    for m, r in res.get("std_ratio_vs_sequential", {}).items():
        cells = "".join(f"{r[k]:>26.2f}" if r[k] is not None else f"{'-':>26}" for k in MEASURES)
        print(f"std sequential/{m:<11}" + cells)
    print("cost-model fit (rel RMS error, R^2):")
    for mod, d in res["calibration"].items():
        for phase, f in d.items():
            txt = f.get("error") or f"rel_rms {f['rel_rms']:.3f}  R^2 {f['r2']:.3f}"
            print(f"  {mod:<28}{phase:<9}{txt}")
    print(
        "simulated 1F1B iteration (K=k: 1 encoder stage + k LLM stages; K=ppN: N stages laid"
        " as entrain's proxy lays them; K=planN: N stages at the planner's layer ranges, told to"
        " entrain), seconds:"
    )
    for k, d in res["simulation"].items():
        cells = "  ".join(
            f"{m} {v['iteration_time_s']:.4f}"
            + (f" (x{v['speedup_vs_sequential']:.2f})" if "speedup_vs_sequential" in v else "")
            for m, v in d.items()
        )
        print(f"  K={k}: {cells}")
        if "sequential" in d and len(d["sequential"]["per_iteration_s"]) > 1:
            # the ratio iteration by iteration: a mean can hide one iteration that decides it
            seq = d["sequential"]["per_iteration_s"]
            per = "  ".join(
                f"{m} " + " / ".join(f"{s / t:.2f}x" for s, t in zip(seq, v["per_iteration_s"]))
                for m, v in d.items()
                if m != "sequential"
            )
            print(f"       per iteration vs sequential: {per}")
