"""Layout pieces of the static planner: the model as a chain of layer units, balanced
stage splits, and the per-GPU memory estimate.

Memory per GPU (stated so it can be checked): bf16 weights (2 bytes per
trainable parameter), fp32 gradients (4) and fp32 Adam state with master
weights (12), all over tp, and what the plan's ``sharding`` divides by dp
(:data:`SHARDED_BYTES`): ``none`` 18, ``optimizer`` (ZeRO-1, Megatron's
distributed optimizer) 6 + 12/dp, ``gradients`` (ZeRO-2) the same, because
the adapters hold each rank's whole gradient until the step (balanced
microbatches reduce once per iteration, coalesced), ``full`` (ZeRO-3, FSDP per
block) (2 + 12)/dp + 2 (bf16 gradients accumulate unsharded between
microbatches) plus two of the stage's layers gathered at once (the one
computing and the one prefetched); frozen weights 2 bytes, 2/dp under ``full``;
plus activations of the microbatches in flight on stage s
(1F1B: min(M, S - s) of them; GPipe: all M) at the token cap, 34 * hidden / tp bytes per token and
layer (Korthikanti et al. 2022, with flash attention); plus the deferral buffer
on the stage that receives encoder outputs. With full recomputation only each
layer's bf16 input is kept, plus one layer's working set.

LM-head logits on the stage holding the LLM's last layer (its head): a microbatch at the
token cap makes ``max_tokens x vocab / tp`` logits, the largest single tensor of a small-LLM
step (Llama 3.2 1B at 65k tokens: 15.7 GB in bf16). The adapters' loss
(``adapters/common.py``, ``loss_sums``) runs ``F.cross_entropy(logits.float(), ...)``, so
its forward peak holds the bf16 logits, their fp32 copy and the fp32 log-softmax (2 + 4 + 4
bytes per logit, :data:`LOGIT_BYTES`); the log-softmax stays saved for the backward of every
microbatch in flight (1F1B: one on the last stage; GPipe: all M).
"""

from __future__ import annotations

import numpy as np

from .cost_model import SampleCosts
from .plan import SHARDING, StagePlan, StageSegment
from .presets import ModelSpec

__all__ = [
    "ACT_BYTES_PER_TOKEN_LAYER",
    "LOGIT_BYTES",
    "logits_bytes",
    "layer_units",
    "split_chain",
    "stages_for",
    "stage_params",
    "memory_gb",
    "SHARDED_BYTES",
    "weight_bytes",
]

ACT_BYTES_PER_TOKEN_LAYER = 34.0  # x hidden / tp
LOGIT_BYTES = (2.0, 4.0, 4.0)
"""Per logit at the loss: bf16 logits, their fp32 copy (the loss upcasts), fp32 log-softmax
(saved for backward, so held per microbatch in flight)."""

SHARDED_BYTES = {
    "none": (18.0, 0.0),
    "optimizer": (6.0, 12.0),
    "gradients": (6.0, 12.0),
    "full": (2.0, 14.0),
}
"""Per trainable parameter: (bytes every rank holds, bytes divided by dp) for each sharding."""


def weight_bytes(train: float, frozen: float, dp: int, sharding: str) -> float:
    """Bytes of weights, gradients and optimizer state per GPU (before tp) for one stage."""
    if sharding not in SHARDING:
        raise ValueError(f"sharding {sharding!r}: one of {SHARDING}")
    whole, split = SHARDED_BYTES[sharding]
    return train * (whole + split / dp) + frozen * (2.0 / dp if sharding == "full" else 2.0)


def layer_units(model: ModelSpec, costs: SampleCosts, batches: np.ndarray):
    """The model as a chain of layer units: (encoder index or None, layer, mean cost per batch)."""
    out = []
    for e, enc in enumerate(model.encoders):
        for layer in range(enc.layers):
            f, b = costs.stage_cost(e, layer, layer + 1, layer == 0, layer == enc.layers - 1)
            out.append((e, layer, float((f + b)[batches].sum(axis=1).mean())))
    n = model.llm.layers
    for layer in range(n):
        f, b = costs.stage_cost(None, layer, layer + 1, layer == 0, layer == n - 1)
        out.append((None, layer, float((f + b)[batches].sum(axis=1).mean())))
    return out


def split_chain(costs: list[float], k: int) -> list[int] | None:
    """Cut a chain into ``k`` non-empty contiguous groups minimising the largest sum (boundaries)."""
    n = len(costs)
    if k > n or k < 1:
        return None
    c = np.asarray(costs)
    prefix = np.concatenate([[0.0], np.cumsum(c)])

    def cuts_for(limit: float) -> list[int] | None:
        cuts, start = [], 0
        while start < n:
            end = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
            end = max(end, start + 1)
            cuts.append(end)
            start = end
        return cuts if len(cuts) <= k else None

    lo, hi = float(c.max()), float(c.sum())
    while hi - lo > 1e-6 * hi:
        mid = (lo + hi) / 2
        if cuts_for(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = cuts_for(hi * (1 + 1e-9)) or [n]
    while len(cuts) < k:  # split the largest group that has more than one unit
        bounds = [0] + cuts
        sizes = [(prefix[b] - prefix[a], a, b) for a, b in zip(bounds, bounds[1:]) if b - a > 1]
        _, a, b = max(sizes)
        mid = a + (b - a) // 2
        cuts = sorted(cuts + [mid])
    return cuts


def stages_for(model: ModelSpec, units, pp: int, enc_stages: int) -> tuple[StagePlan, ...] | None:
    """Stages with ``enc_stages`` pure encoder stages (0: encoders share the first LLM stage)."""
    n_enc = sum(m.layers for m in model.encoders)
    enc_units, llm_units = units[:n_enc], units[n_enc:]
    groups: list[list[tuple]] = []
    if enc_stages:
        cuts = split_chain([u[2] for u in enc_units], enc_stages)
        if cuts is None:
            return None
        start = 0
        for c in cuts:
            groups.append(enc_units[start:c])
            start = c
        llm_cuts = split_chain([u[2] for u in llm_units], pp - enc_stages)
        if llm_cuts is None:
            return None
        start = 0
        for c in llm_cuts:
            groups.append(llm_units[start:c])
            start = c
    else:
        # encoders ride on the first stage: treat them as weight in front of the LLM chain
        head = sum(u[2] for u in enc_units)
        costs = [u[2] for u in llm_units]
        costs[0] += head
        llm_cuts = split_chain(costs, pp)
        if llm_cuts is None:
            return None
        start = 0
        for i, c in enumerate(llm_cuts):
            groups.append((enc_units if i == 0 else []) + llm_units[start:c])
            start = c
    stages = []
    for s, g in enumerate(groups):
        segs = []
        for key in dict.fromkeys(u[0] if u[0] is not None else -1 for u in g):
            e = None if key == -1 else key
            layers = [u[1] for u in g if (u[0] if u[0] is not None else -1) == key]
            mod = model.llm if e is None else model.encoders[e]
            name = "llm" if e is None else mod.name
            a, b = min(layers), max(layers) + 1
            segs.append(StageSegment(name, e, a, b, a == 0, b == mod.layers))
        stages.append(StagePlan(s, tuple(segs), float(sum(u[2] for u in g))))
    return tuple(stages)


def stage_params(model: ModelSpec, st: StagePlan) -> tuple[float, float]:
    """(trainable, frozen) parameters held by a stage."""
    train = frozen = 0.0
    for seg in st.segments:
        mod = model.llm if seg.encoder_index is None else model.encoders[seg.encoder_index]
        p = (seg.layer_end - seg.layer_start) * mod.layer_parameters()
        if seg.first:
            p += mod.embed_parameters()
        if seg.last:
            p += mod.head_parameters(model.llm.hidden)
        if mod.frozen:
            frozen += p
        else:
            train += p
    return train, frozen


def logits_bytes(model: ModelSpec, st: StagePlan, tp: int, inflight: int, max_tokens: int) -> float:
    """Bytes of LM-head logits and loss tensors on stage ``st`` (0 unless it holds the LM head):
    one microbatch's transient bf16 logits and fp32 copy, plus the saved fp32 log-softmax of
    each of the ``inflight`` microbatches (see the module docstring)."""
    if not any(seg.encoder_index is None and seg.last for seg in st.segments):
        return 0.0
    bf16, copy, saved = LOGIT_BYTES
    per_logit = bf16 + copy + saved * max(1, inflight)
    return float(max_tokens) * model.llm.vocab * per_logit / tp


def memory_gb(
    model,
    stages,
    tp,
    dp,
    m,
    max_tokens,
    enc_tokens,
    defer_budget,
    recompute=False,
    params=None,
    schedule="1f1b",
    sharding="optimizer",
) -> tuple[float, ...]:
    """GB per GPU of every stage (see the module docstring); ``params``: stage_params per stage;
    ``recompute``: one flag for every stage, or one per stage.

    GPipe keeps the activations of all M microbatches on every stage; 1F1B at
    most S - s on stage s. The stage with the LM head also holds the logits and the loss's
    fp32 tensors (:func:`logits_bytes`).
    """
    pp = len(stages)
    params = params if params is not None else [stage_params(model, st) for st in stages]
    out = []
    receives_encoder_output = next(
        (i for i, st in enumerate(stages) if any(s.encoder_index is None for s in st.segments)), 0
    )
    flags = [bool(recompute)] * pp if isinstance(recompute, bool) else list(recompute)
    for s, st in enumerate(stages):
        train, frozen = params[s]
        weights = weight_bytes(train, frozen, dp, sharding) / tp
        if sharding == "full":  # two layers gathered at once
            layers = sum(seg.layer_end - seg.layer_start for seg in st.segments)
            weights += 2 * 2 * (train + frozen) / max(1, layers) / tp
        recompute = flags[s]
        inflight = m if schedule == "gpipe" else min(m, pp - s)
        act = 0.0
        peak_layer = 0.0  # full recomputation: one layer's activations live at a time
        for seg in st.segments:
            mod = model.llm if seg.encoder_index is None else model.encoders[seg.encoder_index]
            toks = max_tokens if seg.encoder_index is None else enc_tokens
            layer = toks * ACT_BYTES_PER_TOKEN_LAYER * mod.hidden / tp
            n_layers = seg.layer_end - seg.layer_start
            if recompute:  # only each layer's input (bf16) is kept
                act += n_layers * toks * 2 * mod.hidden
                peak_layer = max(peak_layer, layer)
            else:
                act += n_layers * layer
        total = weights + act * inflight + peak_layer
        total += logits_bytes(model, st, tp, inflight, max_tokens)
        if s == receives_encoder_output:
            total += defer_budget * model.llm.hidden * 2
        out.append(total / 2**30)
    return tuple(out)
