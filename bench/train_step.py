"""Real forward/backward times of a small MLLM per microbatch: sequential versus Entrain.

Forms global batches of a named workload, assigns microbatches with
``entrain_data.assignment.assign`` for each method, builds the real input
tensors of every microbatch (random pixel patches of each image's grid, random
token ids of each sample's packed length) and times, per microbatch, the
vision encoder's forward and backward on its encoder set and the LLM's forward
and backward on its LLM set. It reports the mean and standard deviation of
those times per method (the paper's measure: vision forward std 208 -> 19.6 ms),
fits the cost model to them (``entrain_data.cost_model.calibrate``: fit
error), and feeds them to the pipeline simulator (1 encoder stage + K LLM
stages) for a simulated iteration time per method.

GPU (default when CUDA is present): a Qwen2.5-VL-shaped ViT (16 layers, ~330M
parameters) and Llama-3.2-1B, bf16 weights, activation recompute per layer,
flash / memory-efficient SDPA only. Audio workloads (``--workload
vision-audio``) add a Whisper-large-v3-shaped audio encoder (16 layers); the
encoder stage's time is then the sum of both encoders (per encoder in the JSON).
CPU CI mode: ``python bench/train_step.py --device cpu --tiny`` (tiny dims,
images capped at 256 patches, 3 s audio windows, text lengths / 16), seconds.
``--repeats N`` times every microbatch N times and keeps each measure's median: small
microbatches (30-50 ms on an H200) are otherwise decided by single spikes.

The simulated pipeline holds the encoder(s) on one stage and splits the
measured LLM times evenly over K stages; the encoder stage's backward is
timed on the samples whose gradient arrives with L_j (split backward).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import pick_stages  # noqa: E402
from _train_step_model import (  # noqa: E402
    AudioTower,
    DecoderLLM,
    MicrobatchInputs,
    VisionTower,
    build_audio_inputs,
    build_llm_inputs,
    build_vision_inputs,
    item_grids,
)
from _train_step_report import MEASURES, print_table, report  # noqa: E402

from entrain_data.assignment import assign  # noqa: E402
from entrain_data.cost_model import per_sample_costs  # noqa: E402
from entrain_data.metadata import SampleTable  # noqa: E402
from entrain_data.presets import ModelSpec, load_module  # noqa: E402
from entrain_data.simulator import stage_shares  # noqa: E402
from entrain_data.workloads import synthesize  # noqa: E402

__all__ = ["main", "bench_spec"]

log = logging.getLogger("bench.train_step")
RESULTS = Path(__file__).resolve().parent / "results"
VISION_PRESETS = ("qwen2.5-vl-vision", "qwen2.5-vl-vision-1280")  # the towers VisionTower builds


def bench_spec(
    tiny: bool,
    vision_layers: int | None = None,
    llm_layers: int | None = None,
    audio: bool = False,
    audio_layers: int | None = None,
    vision_preset: str = "qwen2.5-vl-vision",
) -> ModelSpec:
    """The ModelSpec of the timed model (the cost model prices exactly these shapes).

    GPU: the Qwen2.5-VL ViT cut to 16 layers (~330M), Llama-3.2-1B, and with
    ``audio`` the Whisper-large-v3 encoder cut to 16 layers. Tiny: the same
    families with toy widths, images capped at 256 patches, 3 s audio windows.
    ``vision_preset`` ``qwen2.5-vl-vision-1280`` caps images at 1280 LLM tokens (the
    paper-like regime: no single image outweighs a mean microbatch at 4 samples each).
    """
    if vision_preset not in VISION_PRESETS:
        raise ValueError(f"vision_preset must be one of {VISION_PRESETS}, got {vision_preset!r}")
    vit = load_module(vision_preset)
    llm = load_module("llama-3.2-1b")
    aud = load_module("whisper-large-v3-encoder")
    if tiny:
        vit = dataclasses.replace(
            vit, name="tiny-vit", hidden=32, layers=2, ffn=64, heads=2, kv_heads=2,
            max_pixels=64 * 28 * 28, video_max_pixels=0, video_total_pixels=0,
            full_attention_layers=(1,),
        )  # fmt: skip
        llm = dataclasses.replace(
            llm, name="tiny-llm", hidden=32, layers=2, ffn=64, heads=4, kv_heads=2,
            head_dim=8, vocab=512,
        )  # fmt: skip
        aud = dataclasses.replace(
            aud, name="tiny-audio", hidden=32, layers=2, ffn=64, heads=2, kv_heads=2,
            n_mels=16, audio_window_seconds=3.0,
        )  # fmt: skip
    if vision_layers is not None or not tiny:
        n = vision_layers if vision_layers is not None else 16
        full = tuple(i for i in vit.full_attention_layers if i < n) or (n - 1,)
        vit = dataclasses.replace(
            vit, name=f"{vit.name}-{n}l", layers=n, full_attention_layers=full
        )
    if llm_layers is not None:
        llm = dataclasses.replace(llm, name=f"{llm.name}-{llm_layers}l", layers=llm_layers)
    if audio_layers is not None or not tiny:
        n = audio_layers if audio_layers is not None else 16
        aud = dataclasses.replace(aud, name=f"{aud.name}-{n}l", layers=n)
    encoders = (vit, aud) if audio else (vit,)
    return ModelSpec(encoders=encoders, llm=llm, name="+".join(e.name for e in encoders + (llm,)))


def _scaled_text(table: SampleTable, scale: int) -> SampleTable:
    if scale == 1:
        return table
    text = np.maximum(1, -(-table.text_tokens // scale)).astype(np.int64)
    return dataclasses.replace(table, text_tokens=text)


class _Timer:
    """Seconds of one call: CUDA events around it on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def _time_microbatch(towers, llm, mb: MicrobatchInputs, arrival, timer: _Timer) -> dict:
    """Forward and backward of every encoder on E_j and of the LLM on L_j, each timed alone.

    ``arrival`` (encoder inputs of L_j's samples, or None when L_j = E_j): split
    backward runs a deferred sample's encoder backward when its gradient arrives,
    so the encoder backward of microbatch j in the pipeline covers L_j's samples.
    """
    out: dict = dict.fromkeys(MEASURES + ("encoder_bwd_arrival",), 0.0)
    out["per_encoder"] = {}
    llm.zero_grad(set_to_none=True)
    for e, (name, tower) in enumerate(towers):
        tower.zero_grad(set_to_none=True)
        t = {"fwd": 0.0, "bwd": 0.0, "bwd_arrival": 0.0}
        v = mb.encoders[e]
        if v is not None:
            y, t["fwd"] = timer(partial(tower.forward_inputs, v))
            _, t["bwd"] = timer(partial(y.backward, v.grad_out))
            del y
        t["bwd_arrival"] = t["bwd"]
        if arrival is not None:
            t["bwd_arrival"] = 0.0
            if arrival[e] is not None:
                y = tower.forward_inputs(arrival[e])
                _, t["bwd_arrival"] = timer(partial(y.backward, arrival[e].grad_out))
                del y
        out["per_encoder"][name] = t
        out["encoder_fwd"] += t["fwd"]
        out["encoder_bwd"] += t["bwd"]
        out["encoder_bwd_arrival"] += t["bwd_arrival"]
    lm = mb.llm
    if lm is not None:
        loss, out["llm_fwd"] = timer(
            lambda: llm(lm.input_ids, lm.labels, lm.media, lm.media_mask, lm.plan)
        )
        _, out["llm_bwd"] = timer(lambda: loss.backward())
        del loss
    return out


def _median_of(runs: list[dict]) -> dict:
    """Per-measure median of a microbatch's repeated timings: on a GPU a single 100-250 ms
    spike (seen on the H200 in both methods) otherwise decides a 30 ms microbatch."""
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0] if k != "per_encoder"}
    out["per_encoder"] = {
        name: {k: float(np.median([r["per_encoder"][name][k] for r in runs])) for k in t}
        for name, t in runs[0]["per_encoder"].items()
    }
    return out


def _check_tokens(table: SampleTable, grids: np.ndarray, cfg, costs) -> None:
    """The model's patch counts must be the cost model's, or calibration compares apples to pears."""
    patches = grids.prod(axis=1)
    owners = np.repeat(np.arange(len(table)), np.diff(table.image_offsets))
    per_sample = np.bincount(owners, weights=patches, minlength=len(table)).astype(np.int64)
    if not np.array_equal(per_sample, costs.encoder_tokens[:, 0]):
        raise RuntimeError("bench model patch counts differ from the cost model's encoder tokens")
    merged = per_sample // cfg.merge**2
    if not np.array_equal(merged, costs.vision_tokens):
        raise RuntimeError("bench model vision tokens differ from the cost model's")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny dims and sizes (CPU CI)")
    p.add_argument("--workload", default="qwen2vl-dynamic")
    p.add_argument("--methods", default="sequential,entrain", help="comma-separated")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--microbatches", type=int, default=None, help="per replica")
    p.add_argument("--iterations", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="untimed microbatches first")
    p.add_argument(
        "--repeats", type=int, default=1, help="timings per microbatch; the median is kept"
    )
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--defer-budget", type=int, default=None)
    p.add_argument("--llm-stages", default="1,2,3", help="LLM pipeline stages to simulate")
    p.add_argument(
        "--pp",
        type=int,
        default=0,
        help="the plan's pipeline depth: entrain is told it (assign(pipeline_stages=)) and the "
        "report also simulates it, each microbatch's measured times split over the stages as "
        "entrain's proxy lays the modules (0: not told)",
    )
    p.add_argument(
        "--layout",
        choices=("proxy", "plan"),
        default="proxy",
        help="with --pp: proxy tells entrain the depth only; plan lays the stages at layer "
        "boundaries as the planner does (bench/_common.pick_stages), tells entrain their "
        "shares (assign(stage_shares=), as the loader service does; one column per encoder, where the "
        "service sums encoders laid out alike) and simulates them too",
    )
    p.add_argument("--vision-layers", type=int, default=None)
    p.add_argument(
        "--vision-preset",
        choices=VISION_PRESETS,
        default=VISION_PRESETS[0],
        help="the vision tower's preset (-1280: images capped at 1280 LLM tokens)",
    )
    p.add_argument("--llm-layers", type=int, default=None)
    p.add_argument("--audio-layers", type=int, default=None, help="audio workloads")
    p.add_argument("--text-scale", type=int, default=None, help="divide text lengths by this")
    p.add_argument(
        "--recompute",
        choices=("auto", "on", "off"),
        default="auto",
        help="activation recompute per layer (auto: on for cuda)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="weights and activations (auto: bf16 on cuda, fp32 on cpu)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads (tiny: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    if a.pp < 0:
        p.error(f"--pp must be >= 0, got {a.pp}")
    if a.layout == "plan" and not a.pp:
        p.error("--layout plan needs the depth --pp")
    tiny_defaults = dict(
        global_batch=8, dp=2, microbatches=2, iterations=1, warmup=1, text_scale=16
    )
    gpu_defaults = dict(
        global_batch=128, dp=2, microbatches=16, iterations=2, warmup=4, text_scale=1
    )
    for k, v in (tiny_defaults if a.tiny else gpu_defaults).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.out is None:
        a.out = RESULTS / ("train_step_tiny.json" if a.tiny else "train_step.json")
    return a


def _fast_attention(device: torch.device):
    """On a GPU only flash / memory-efficient attention: a silent fall-back to the math
    kernel would materialise [L, L] scores per image and time the wrong thing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def timing_order(methods: list[str], iterations: int, count: int) -> list[tuple[int, int, str]]:
    """(iteration, microbatch position, method) in the order they are timed: position i of
    every method in turn, the method that goes first rotating with i and the iteration.

    Timed method after method, the one timed first also paid the GPU's warm-up and drift: on
    ``vision-audio`` (H100 and H200), ``sequential``, timed first in iteration 0, ran 1.18x
    slower than entrain there and 0.94x in iteration 1, timed after it."""
    out = []
    for it in range(iterations):
        for i in range(count):
            turn = (i + it) % len(methods)
            out += [(it, i, m) for m in methods[turn:] + methods[:turn]]
    return out


def _measure(
    a, methods, assignments, inputs, encoders, towers, llm, timer
) -> dict[str, list[dict]]:
    """Warm up, then time every microbatch of every method in :func:`timing_order`."""
    rows0, asg0 = assignments[(methods[0], 0)]
    for w in range(a.warmup):  # untimed: allocator, kernels, lazy imports
        r, j = divmod(w % (a.dp * a.microbatches), a.microbatches)
        mb = inputs(rows0[asg0.encoder_sets[r][j]], rows0[asg0.llm_sets[r][j]])
        _time_microbatch(towers, llm, mb, None, timer)
    per: dict[str, list[dict]] = {m: [] for m in methods}
    count = a.dp * a.microbatches
    for it, i, m in timing_order(methods, a.iterations, count):
        r, j = divmod(i, a.microbatches)
        rows, asg = assignments[(m, it)]
        e_rows = rows[asg.encoder_sets[r][j]]
        l_rows = rows[asg.llm_sets[r][j]]
        mb = inputs(e_rows, l_rows)
        arrival = None
        if set(e_rows.tolist()) != set(l_rows.tolist()):
            arrival = encoders(l_rows)
        runs = [_time_microbatch(towers, llm, mb, arrival, timer) for _ in range(a.repeats)]
        t = _median_of(runs)
        per[m].append({"iteration": it, "replica": r, "microbatch": j,
                       "encoder_rows": e_rows.tolist(), "llm_rows": l_rows.tolist(),
                       **t})  # fmt: skip
        del mb, arrival
        if all(len(v) == (it + 1) * count for v in per.values()):  # the iteration's last
            log.info("iteration %d: %d microbatches of each method timed", it, count)
    return per


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table, write the JSON; return the result dict."""
    a = _parse(argv)
    t_start = time.perf_counter()
    device = torch.device(a.device)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    torch.manual_seed(a.seed)
    if a.threads or (a.tiny and device.type == "cpu"):
        torch.set_num_threads(a.threads or 1)  # steadier timings on a shared CPU
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
    bf16 = a.dtype == "bf16" or (a.dtype == "auto" and device.type == "cuda")
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute = a.recompute == "on" or (a.recompute == "auto" and device.type == "cuda")

    raw = synthesize(a.workload, a.global_batch * a.iterations, a.seed)
    has_audio = len(raw.audio_seconds) > 0
    spec = bench_spec(
        a.tiny, a.vision_layers, a.llm_layers, has_audio, a.audio_layers, a.vision_preset
    )
    vit_cfg = spec.encoders[0]
    table = _scaled_text(raw, a.text_scale)
    costs = per_sample_costs(table, spec)
    enc_cost, llm_cost, tokens = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens

    kinds = {"vision": VisionTower, "audio": AudioTower}
    towers = [
        (c.name, kinds[c.kind](c, spec.llm.hidden, recompute).to(device=device, dtype=dtype))
        for c in spec.encoders
    ]
    llm = DecoderLLM(spec.llm, recompute).to(device=device, dtype=dtype)
    params = {name: sum(p.numel() for p in t.parameters()) for name, t in towers}
    params["llm"] = sum(p.numel() for p in llm.parameters())
    log.info(
        "model %s: %s parameters", spec.name, {k: f"{v / 1e6:.1f}M" for k, v in params.items()}
    )
    gen = torch.Generator(device=device).manual_seed(a.seed)
    grids = item_grids(table, vit_cfg)
    _check_tokens(table, grids, vit_cfg, costs)
    media = costs.vision_tokens + costs.audio_tokens

    def encoders(rows: np.ndarray) -> tuple:
        return tuple(
            build_vision_inputs(table, c, grids, rows, device, dtype, gen, spec.llm.hidden)
            if c.kind == "vision"
            else build_audio_inputs(table, c, rows, device, dtype, gen, spec.llm.hidden)
            for c in spec.encoders
        )

    def inputs(rows_e: np.ndarray, rows_l: np.ndarray) -> MicrobatchInputs:
        return MicrobatchInputs(
            encoders=encoders(rows_e),
            llm=build_llm_inputs(spec.llm, costs.llm_tokens, media, rows_l, device, dtype, gen),
        )

    shares = None  # the plan's stages, told to entrain and simulated by the report
    if a.layout == "plan":
        batches = np.arange(a.global_batch * a.iterations).reshape(a.iterations, -1)
        stages = pick_stages(spec, costs, batches, a.pp)
        shares = stage_shares(costs, stages, rows=batches.ravel())
        log.info("plan layout: %s", [st.module for st in stages])
    assignments: dict[tuple[str, int], object] = {}
    for it in range(a.iterations):
        rows = np.arange(it * a.global_batch, (it + 1) * a.global_batch)
        for m in methods:
            told = {"stage_shares": shares} if shares is not None and m == "entrain" else {}
            asg = assign(
                enc_cost[rows], llm_cost[rows], tokens[rows], dp=a.dp,
                microbatches=a.microbatches, max_tokens=a.max_tokens,
                defer_budget=a.defer_budget, method=m, seed=a.seed, iteration=it,
                pipeline_stages=a.pp or None, **told,
            )  # fmt: skip
            assignments[(m, it)] = (rows, asg)

    with _fast_attention(device):
        per = _measure(a, methods, assignments, inputs, encoders, towers, llm, _Timer(device))
    result = report(a, spec, table, methods, per, params, device, shares)
    result["wall_seconds"] = time.perf_counter() - t_start
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    cal_path = a.out.with_name(a.out.stem + "_calibration.json")
    cal_path.write_text(json.dumps(result["calibration_file"], indent=1))
    print_table(result)
    print(f"wrote {a.out} and {cal_path.name} ({result['wall_seconds']:.1f} s)")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
