"""Shared set-up of the assignment benchmarks: models, stage layouts, caps, workload tables."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from entrain_data.cost_model import SampleCosts, per_sample_costs
from entrain_data.metadata import SampleTable
from entrain_data.plan_layout import layer_units, stages_for
from entrain_data.presets import ModelSpec
from entrain_data.real_workloads import list_real_workloads, real_workload
from entrain_data.token_caps import count_floor, token_caps
from entrain_data.workloads import synthesize

__all__ = [
    "DEFAULT_MODELS",
    "MIXES",
    "MODELS",
    "RESULTS",
    "SHARED_DATA",
    "caps",
    "mixed_table",
    "patch_caps",
    "pick_stages",
    "tables",
    "model_costs",
]

RESULTS = Path(__file__).resolve().parent / "results"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# name -> (encoders, llm): the paper's pairing and a vision + audio + LLM model
MODELS = {
    "vl-1b": (("qwen2.5-vl-vision",), "llama-3.2-1b"),
    "vla-3b": (("qwen2.5-vl-vision", "whisper-large-v3-encoder"), "llama-3.2-3b"),
    "vl-1b-1280": (("qwen2.5-vl-vision-1280",), "llama-3.2-1b"),
    # fixed-resolution images (SigLIP at 384 px) with speech padded to 30 s: every item of
    # either encoder costs the same, so encoder work is a count of each kind (not in the
    # default run: `--models vla-fixed`)
    "vla-fixed": (("siglip-so400m", "whisper-large-v3-encoder"), "llama-3.2-1b"),
}
DEFAULT_MODELS = ("vl-1b", "vla-3b", "vl-1b-1280")


def caps(tokens: np.ndarray, dp: int, m: int) -> tuple[int, int]:
    """Token cap and deferral budget of this batch by the planner's rule (:func:`token_caps`:
    1.5x a mean microbatch, at least the largest sample, a replica's share, and the counting
    floor of this batch's sizes, 256-aligned; the budget 2x a mean microbatch)."""
    tok = np.asarray(tokens, dtype=np.int64)
    floor = count_floor(-np.sort(-tok), dp * m)
    return token_caps(int(tok.sum()), int(tok.max()), dp, m, None, floor)


def patch_caps(patches: np.ndarray, dp: int, m: int) -> np.ndarray:
    """[E] encoder patch cap per encoder set, by the token cap's rule (:func:`caps`), per
    encoder column."""
    pt = np.asarray(patches, dtype=np.int64).reshape(len(patches), -1)
    return np.array(
        [max(caps(pt[:, e], dp, m)[0], 256) for e in range(pt.shape[1])], dtype=np.int64
    )


def pick_stages(model: ModelSpec, costs: SampleCosts, batches: np.ndarray, pp: int):
    """The pp-stage layout (encoder stages first) whose busiest stage carries the least mean
    load: layer ranges proportional to profiled load, as the static planner would pick."""
    units = layer_units(model, costs, batches)
    best = None
    for enc_stages in range(0, pp):
        st = stages_for(model, units, pp, enc_stages)
        if st is None:
            continue
        worst = max(s.expected_load for s in st)
        if best is None or worst < best[0]:
            best = (worst, st)
    if best is None:
        raise ValueError(f"no {pp}-stage layout for {model.module_names}")
    return best[1]


def model_costs(name: str, table: SampleTable, frozen: bool = False) -> SampleCosts | None:
    """Costs of ``table`` under model ``name`` (``frozen``: its encoders run forward only);
    None when the model lacks a needed encoder."""
    encs, llm = MODELS[name]
    has_audio = bool(len(table.audio_seconds)) and float(np.sum(table.audio_seconds)) > 0
    if has_audio and "whisper-large-v3-encoder" not in encs:
        return None
    return per_sample_costs(table, ModelSpec.from_names(list(encs), llm, frozen_encoders=frozen))


# mixes of the real corpora, as training sets mix them (name -> corpus -> share of samples):
# the held-out checks of issue 12 ran five such mixes (captions, instruction chat, documents
# ...) that this file's single-corpus tables do not cover
MIXES = {
    "captions": {"coco-captions": 0.7, "llava-instruct": 0.3},
    "chat": {"llava-instruct": 0.8, "coco-captions": 0.1, "sroie-docs": 0.1},
    "docs": {"sroie-docs": 0.5, "llava-instruct": 0.5},
    "omni": {
        "llava-instruct": 0.4,
        "coco-captions": 0.2,
        "librispeech": 0.15,
        "common-voice-ps": 0.1,
        "video-activitynet": 0.15,
    },
    "video": {"video-charades": 0.4, "video-nextqa": 0.3, "video-activitynet": 0.3},
    "speech": {"librispeech": 0.5, "common-voice-id": 0.25, "common-voice-ps": 0.25},
    "video-docs": {"video-nextqa": 0.3, "sroie-docs": 0.3, "llava-instruct": 0.4},
}


def mixed_table(mix: dict[str, float], samples: int, seed: int) -> SampleTable:
    """``samples`` rows drawn from the real corpora of ``mix`` in its shares (with
    replacement where a corpus is smaller; a repeated row's key gets ``#k``), shuffled."""
    rng = np.random.default_rng(seed)
    parts = []
    for name, share in mix.items():
        t = real_workload(name, SHARED_DATA)
        counts = np.bincount(rng.choice(len(t), int(round(samples * share))), minlength=len(t))
        for k in range(1, int(counts.max(initial=0)) + 1):
            c = t.take(np.flatnonzero(counts >= k))
            parts.append(c if k == 1 else replace(c, keys=np.array([f"{x}#{k}" for x in c.keys])))
    t = SampleTable.concat(parts)
    return t.take(rng.permutation(len(t)))


def tables(samples: int, seed: int, real: bool, mixes: bool = False) -> dict[str, SampleTable]:
    """Every named synthetic workload, plus the real tables when ../shared/data is present
    (and with ``mixes`` the :data:`MIXES` of them, ``mix:NAME``)."""
    from entrain_data.workloads import list_workloads

    out = {name: synthesize(name, samples, seed) for name in list_workloads()}
    if real and SHARED_DATA.is_dir():
        for name in list_real_workloads():
            out[f"real:{name}"] = real_workload(name, SHARED_DATA)
    if mixes and SHARED_DATA.is_dir():
        for name, mix in MIXES.items():
            out[f"mix:{name}"] = mixed_table(mix, samples, seed)
    return out


def workload_names() -> list[str]:
    """Every named synthetic workload, then ``real:NAME`` for each real table of
    ../shared/data when present (the balance bench's rows without the mixes)."""
    from entrain_data.workloads import list_workloads

    real = [f"real:{n}" for n in list_real_workloads()] if SHARED_DATA.is_dir() else []
    return list(list_workloads()) + real


def workload_table(name: str, samples: int) -> SampleTable:
    """A synthetic workload of ``samples`` rows (seed 0), or ``real:NAME`` from ../shared/data."""
    if name.startswith("real:"):
        return real_workload(name[len("real:") :], SHARED_DATA)
    return synthesize(name, samples, seed=0)


def drawn_batch(costs: SampleCosts, b: int, dp: int):
    """(encoder costs, LLM costs, tokens, encoder patches) of ``b`` rows of ``costs`` drawn with
    seed ``b + dp`` (with replacement where the table is smaller): the latency bench's batch."""
    enc, llm, tok = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens
    pt = costs.encoder_tokens.astype(np.int64)
    rows = np.random.default_rng(b + dp).choice(len(enc), b, replace=len(enc) < b)
    return enc[rows], llm[rows], tok[rows], pt[rows]
