"""Per-sample compute of every module (each encoder, the LLM), from the models' configs.

Forward FLOPs of one transformer layer on a sequence of ``n`` tokens:

- linear terms ``2 n (h (q + 2 kv) + q h + k h f)``: QKV projection (GQA: ``kv``
  = kv_heads * head_dim), output projection, MLP with ``k = 3`` matrices when
  gated (SwiGLU) else 2;
- attention ``4 q s^2`` summed over every attended sequence ``s`` (QK^T and
  AV): per image/frame group/tile for a ViT (per window in window-attention
  layers), per 30 s window for Whisper, per packed sample for the LLM, halved
  there because variable-length causal attention skips the masked half.

Fixed parts: patch embedding / audio conv stem and the projector into the LLM
(encoders), the LM head (LLM). FLOPs become seconds on a reference GPU
(:class:`Hardware`: H100 SXM bf16 dense peak times the efficiency matmuls and
flash attention typically reach in training). Training multiplies forward by
``1 + bwd_factor``: 2.0 when trainable (input and weight gradients), 0.0 for a
frozen encoder (forward only). Times are for one GPU (tp = 1): a planner
divides by its tensor-parallel degree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .calibration import Calibration, ModuleFit, fit_coefficients
from .errors import InvalidInput
from .metadata import SampleTable
from .presets import ModelSpec, ModuleConfig
from .tokens import ItemTokens, audio_tokens, vision_tokens

__all__ = [
    "Hardware",
    "H100_BF16",
    "SampleCosts",
    "per_sample_costs",
    "module_features",
    "calibrate",
    "layer_linear_flops",
    "attention_flops_coeff",
]


@dataclass(frozen=True)
class Hardware:
    """Reference GPU: peak dense FLOP/s and the fraction of it each kind of kernel reaches."""

    name: str = "h100-sxm-bf16"
    peak_flops: float = 989.4e12  # H100 SXM, bf16 dense tensor core peak (NVIDIA datasheet)
    linear_efficiency: float = 0.5  # GEMMs in Megatron-style training
    attention_efficiency: float = 0.4  # FlashAttention-2 forward/backward on H100

    def __post_init__(self) -> None:
        if (
            self.peak_flops <= 0
            or not (0 < self.linear_efficiency <= 1)
            or not (0 < self.attention_efficiency <= 1)
        ):
            raise InvalidInput(
                f"hardware {self.name!r}: peak_flops > 0 and efficiencies in (0, 1] required"
            )


H100_BF16 = Hardware()


def layer_linear_flops(cfg: ModuleConfig) -> float:
    """Forward FLOPs per token of one layer's matmuls."""
    q = cfg.heads * cfg.dim_head
    kv = 2 * cfg.kv_heads * cfg.dim_head
    mats = 3 if cfg.gated_mlp else 2
    return 2.0 * (cfg.hidden * (q + kv) + q * cfg.hidden + mats * cfg.hidden * cfg.ffn)


def attention_flops_coeff(cfg: ModuleConfig) -> float:
    """Forward attention FLOPs per squared sequence length of one layer (causal for the LLM)."""
    full = 4.0 * cfg.heads * cfg.dim_head
    return full * (0.5 if cfg.kind == "llm" else 1.0)


def _projector_flops_per_token(cfg: ModuleConfig, llm_hidden: int) -> float:
    return 2.0 * cfg.head_parameters(llm_hidden)


@dataclass(frozen=True, eq=False)
class SampleCosts:
    """Seconds on the reference GPU, per sample (see ``entrain_data/README.md``).

    Encoders may mix layer types (Qwen2.5-VL: window attention except in four
    full-attention layers): ``encoder_layer_fwd`` is the mean over layers, and
    :meth:`stage_cost` uses the exact per-layer split.
    """

    encoder_layer_fwd: np.ndarray  # [N, E]
    encoder_fixed_fwd: np.ndarray  # [N, E] embed + head
    llm_layer_fwd: np.ndarray  # [N]
    llm_fixed_fwd: np.ndarray  # [N]
    encoder_tokens: np.ndarray  # [N, E]
    llm_tokens: np.ndarray  # [N]
    vision_tokens: np.ndarray  # [N]
    audio_tokens: np.ndarray  # [N]
    encoder_bwd_factor: np.ndarray  # [E]
    llm_bwd_factor: float
    encoder_embed_fwd: np.ndarray  # [N, E] patch embedding / conv stem (first stage)
    encoder_head_fwd: np.ndarray  # [N, E] projector into the LLM (last stage)
    encoder_window_layer_fwd: np.ndarray  # [N, E] one window-attention layer
    encoder_full_layer_fwd: np.ndarray  # [N, E] one full-attention layer
    encoder_window_masks: tuple[np.ndarray, ...]  # per encoder, bool [layers]
    llm_embed_fwd: np.ndarray  # [N]
    llm_head_fwd: np.ndarray  # [N]
    encoder_layers: tuple[int, ...]
    llm_layers: int
    module_names: tuple[str, ...]
    # calibrated fixed forward seconds per call (one microbatch through the whole module; a
    # ``step`` fit's constant split as the module's compute is, forward : backward = 1 : bwd)
    encoder_call_overhead: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [E]
    llm_call_overhead: float = 0.0

    def __len__(self) -> int:
        return len(self.llm_tokens)

    @property
    def num_encoders(self) -> int:
        return len(self.encoder_layers)

    def encoder_fwd(self) -> np.ndarray:
        """[N, E] forward over all layers and fixed parts."""
        return (
            self.encoder_layer_fwd * np.asarray(self.encoder_layers, dtype=np.float64)
            + self.encoder_fixed_fwd
        )

    def encoder_cost(self) -> np.ndarray:
        """[N, E] forward + backward over all layers and fixed parts."""
        return self.encoder_fwd() * (1.0 + self.encoder_bwd_factor)

    def llm_fwd(self) -> np.ndarray:
        """[N] forward seconds of every sample through the whole LLM (all layers + embedding/head)."""
        return self.llm_layer_fwd * self.llm_layers + self.llm_fixed_fwd

    def llm_cost(self) -> np.ndarray:
        """[N] forward + backward of the LLM."""
        return self.llm_fwd() * (1.0 + self.llm_bwd_factor)

    def stage_cost(
        self, module: int | None, layer_start: int, layer_end: int, first: bool, last: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """(forward [N], backward [N]) of a stage holding layers ``[layer_start, layer_end)``.

        ``module`` is the encoder's column, ``None`` for the LLM; ``first`` adds
        the embedding, ``last`` the projector or LM head.
        """
        if module is None:
            n_layers = self.llm_layers
        else:
            if not 0 <= module < self.num_encoders:
                raise InvalidInput(
                    f"stage_cost: encoder index {module} out of range 0..{self.num_encoders - 1}"
                )
            n_layers = self.encoder_layers[module]
        if not 0 <= layer_start <= layer_end <= n_layers:
            raise InvalidInput(
                f"stage_cost: layer range [{layer_start}, {layer_end}) outside 0..{n_layers}"
            )
        if module is None:
            fwd = self.llm_layer_fwd * (layer_end - layer_start)
            if first:
                fwd = fwd + self.llm_embed_fwd
            if last:
                fwd = fwd + self.llm_head_fwd
            return fwd, fwd * self.llm_bwd_factor
        mask = self.encoder_window_masks[module][layer_start:layer_end]
        n_win = int(mask.sum())
        n_full = (layer_end - layer_start) - n_win
        fwd = (
            self.encoder_window_layer_fwd[:, module] * n_win
            + self.encoder_full_layer_fwd[:, module] * n_full
        )
        if first:
            fwd = fwd + self.encoder_embed_fwd[:, module]
        if last:
            fwd = fwd + self.encoder_head_fwd[:, module]
        return fwd, fwd * float(self.encoder_bwd_factor[module])

    def call_overhead(
        self, module: int | None, layer_start: int, layer_end: int
    ) -> tuple[float, float]:
        """(forward, backward) seconds per microbatch of a stage holding layers
        ``[layer_start, layer_end)`` of ``module`` (encoder column, None: the LLM): the
        calibrated per-call constant in proportion to the layers held (launches and
        synchronisation are per layer), backward times the module's backward factor."""
        if module is None:
            per_call, n_layers, bwd = self.llm_call_overhead, self.llm_layers, self.llm_bwd_factor
        else:
            if not 0 <= module < len(self.encoder_call_overhead):
                return 0.0, 0.0
            per_call = float(self.encoder_call_overhead[module])
            n_layers = self.encoder_layers[module]
            bwd = float(self.encoder_bwd_factor[module])
        f = per_call * (layer_end - layer_start) / max(1, n_layers)
        return f, f * bwd


@dataclass(frozen=True)
class _Parts:
    """Uncalibrated forward seconds of one module, per sample, split by term."""

    linear_layer: np.ndarray  # one layer's matmuls
    attn_window: np.ndarray  # one window-attention layer's attention
    attn_full: np.ndarray  # one full-attention layer's attention
    embed: np.ndarray
    head: np.ndarray
    window_mask: np.ndarray
    encoder_tokens: np.ndarray
    llm_tokens: np.ndarray

    def features(self) -> tuple[np.ndarray, np.ndarray]:
        """(all-layer linear + fixed, all-layer attention) seconds per sample: calibration's x."""
        n_win = int(self.window_mask.sum())
        n_full = len(self.window_mask) - n_win
        lin = self.linear_layer * len(self.window_mask) + self.embed + self.head
        att = self.attn_window * n_win + self.attn_full * n_full
        return lin, att


def _per_sample(values: np.ndarray, owners: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(owners, weights=values, minlength=n).astype(np.float64)


def _encoder_parts(table: SampleTable, cfg: ModuleConfig, llm_hidden: int, hw: Hardware) -> _Parts:
    n = len(table)
    if cfg.kind == "vision":
        it: ItemTokens = vision_tokens(
            cfg, table.image_frames, table.image_height, table.image_width
        )
        owners = table.image_sample_ids()
        embed_flops_unit = (
            2.0 * cfg.in_channels * cfg.temporal_patch * cfg.patch_size**2 * cfg.hidden
        )
    else:
        it = audio_tokens(cfg, table.audio_seconds)
        owners = table.audio_sample_ids()
        frames_in = cfg.audio_window_seconds * cfg.audio_frame_rate
        out = frames_in / cfg.audio_conv_stride
        embed_flops_unit = (
            2.0 * 3 * (frames_in * cfg.n_mels * cfg.hidden + out * cfg.hidden * cfg.hidden)
        )
    lin_s = layer_linear_flops(cfg) / (hw.peak_flops * hw.linear_efficiency)
    att_s = attention_flops_coeff(cfg) / (hw.peak_flops * hw.attention_efficiency)
    tokens = _per_sample(it.encoder_tokens.astype(np.float64), owners, n)
    llm_tok = _per_sample(it.llm_tokens.astype(np.float64), owners, n)
    return _Parts(
        linear_layer=tokens * lin_s,
        attn_window=_per_sample(it.window_sumsq, owners, n) * att_s,
        attn_full=_per_sample(it.full_sumsq, owners, n) * att_s,
        embed=_per_sample(it.embed_units * embed_flops_unit, owners, n)
        / (hw.peak_flops * hw.linear_efficiency),
        # the projector runs on the merged (vision) or pooled (audio) tokens the LLM receives
        head=llm_tok
        * _projector_flops_per_token(cfg, llm_hidden)
        / (hw.peak_flops * hw.linear_efficiency),
        window_mask=np.asarray(cfg.window_layer_mask(), dtype=bool),
        encoder_tokens=tokens,
        llm_tokens=llm_tok.astype(np.int64),
    )


def _llm_parts(
    table: SampleTable, cfg: ModuleConfig, extra_tokens: np.ndarray, hw: Hardware
) -> _Parts:
    n_tok = table.text_tokens.astype(np.int64) + extra_tokens
    t = n_tok.astype(np.float64)
    lin_s = layer_linear_flops(cfg) / (hw.peak_flops * hw.linear_efficiency)
    att_s = attention_flops_coeff(cfg) / (hw.peak_flops * hw.attention_efficiency)
    attn = t * t * att_s
    return _Parts(
        linear_layer=t * lin_s,
        attn_window=attn,
        attn_full=attn,
        embed=np.zeros(len(t)),  # a table lookup: no FLOPs
        head=t * 2.0 * cfg.vocab * cfg.hidden / (hw.peak_flops * hw.linear_efficiency),
        window_mask=np.zeros(cfg.layers, dtype=bool),
        encoder_tokens=t,
        llm_tokens=n_tok,
    )


def _model_parts(
    table: SampleTable, model: ModelSpec, hw: Hardware
) -> tuple[list[_Parts], _Parts, np.ndarray, np.ndarray]:
    if not isinstance(table, SampleTable):
        raise InvalidInput(f"per_sample_costs: expected a SampleTable, got {type(table).__name__}")
    n = len(table)
    kinds = {e.kind for e in model.encoders}
    if len(table.image_frames) and "vision" not in kinds:
        raise InvalidInput(
            f"{table.origin}: {int((table.image_counts > 0).sum())} sample(s) have images or video but the model has no vision encoder"
        )
    if len(table.audio_seconds) and "audio" not in kinds:
        raise InvalidInput(
            f"{table.origin}: {int((table.audio_counts > 0).sum())} sample(s) have audio but the model has no audio encoder"
        )
    enc = [_encoder_parts(table, e, model.llm.hidden, hw) for e in model.encoders]
    vis = np.zeros(n, dtype=np.int64)
    aud = np.zeros(n, dtype=np.int64)
    seen: set[str] = set()
    for cfg, p in zip(model.encoders, enc):
        if (
            cfg.kind in seen
        ):  # a second encoder of the same modality sees the same items but feeds no new tokens
            continue
        seen.add(cfg.kind)
        if cfg.kind == "vision":
            vis += p.llm_tokens
        else:
            aud += p.llm_tokens
    return enc, _llm_parts(table, model.llm, vis + aud, hw), vis, aud


def _scale(fit: ModuleFit | None) -> tuple[float, float]:
    return (1.0, 1.0) if fit is None else (fit.linear, fit.quadratic)


def _forward_constant(fit: ModuleFit | None, bwd_factor: float) -> float:
    """A fit's per-call constant as forward seconds: a ``step`` fit measured forward +
    backward, which :meth:`SampleCosts.call_overhead` splits again as ``1 : bwd_factor``."""
    if fit is None:
        return 0.0
    return fit.constant / (1.0 + bwd_factor) if fit.phase == "step" else fit.constant


def per_sample_costs(
    table: SampleTable,
    model: ModelSpec,
    hardware: Hardware | None = None,
    calibration: Calibration | dict | None = None,
) -> SampleCosts:
    """Cost every sample of ``table`` under ``model`` (vectorised; 65k samples in well under 1 s)."""
    hw = hardware or H100_BF16
    cal = Calibration.from_dict(calibration) if isinstance(calibration, dict) else calibration
    enc, llm, vis, aud = _model_parts(table, model, hw)
    n, ne = len(table), len(model.encoders)

    def col(vals: list[np.ndarray]) -> np.ndarray:
        return np.stack(vals, axis=1) if vals else np.zeros((n, 0))

    win, full, emb, head, over = [], [], [], [], []
    for cfg, p in zip(model.encoders, enc):
        fit = cal.get(cfg.name) if cal else None
        a, b = _scale(fit)
        win.append(a * p.linear_layer + b * p.attn_window)
        full.append(a * p.linear_layer + b * p.attn_full)
        emb.append(a * p.embed)
        head.append(a * p.head)
        over.append(_forward_constant(fit, 0.0 if cfg.frozen else 2.0))
    masks = tuple(p.window_mask for p in enc)
    win_m, full_m = col(win), col(full)
    n_win = np.array([m.sum() for m in masks], dtype=np.float64)
    layers = np.array([cfg.layers for cfg in model.encoders], dtype=np.float64)
    mean_layer = (
        (win_m * n_win + full_m * (layers - n_win)) / np.maximum(layers, 1) if ne else col([])
    )
    lfit = cal.get("llm") if cal else None
    a, b = _scale(lfit)
    emb_m, head_m = col(emb), col(head)
    return SampleCosts(
        encoder_layer_fwd=mean_layer,
        encoder_fixed_fwd=emb_m + head_m,
        llm_layer_fwd=a * llm.linear_layer + b * llm.attn_full,
        llm_fixed_fwd=a * (llm.embed + llm.head),
        encoder_tokens=col([p.encoder_tokens for p in enc]).astype(np.int64),
        llm_tokens=llm.llm_tokens,
        vision_tokens=vis,
        audio_tokens=aud,
        encoder_bwd_factor=np.array(
            [0.0 if c.frozen else 2.0 for c in model.encoders], dtype=np.float64
        ),
        llm_bwd_factor=1.0 if model.llm.frozen else 2.0,
        encoder_embed_fwd=emb_m,
        encoder_head_fwd=head_m,
        encoder_window_layer_fwd=win_m,
        encoder_full_layer_fwd=full_m,
        encoder_window_masks=masks,
        llm_embed_fwd=a * llm.embed,
        llm_head_fwd=a * llm.head,
        encoder_layers=tuple(c.layers for c in model.encoders),
        llm_layers=model.llm.layers,
        module_names=model.module_names,
        encoder_call_overhead=np.array(over, dtype=np.float64),
        llm_call_overhead=_forward_constant(lfit, 1.0 if model.llm.frozen else 2.0),
    )


def module_features(
    table: SampleTable, model: ModelSpec, module: str, hardware: Hardware | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Uncalibrated forward seconds of ``module`` per sample: (linear + fixed terms, attention terms)."""
    enc, llm, _, _ = _model_parts(table, model, hardware or H100_BF16)
    if module == "llm" or module == model.llm.name:
        return llm.features()
    for cfg, p in zip(model.encoders, enc):
        if cfg.name == module:
            return p.features()
    raise InvalidInput(f"calibrate: no module named {module!r} (have {list(model.module_names)})")


def calibrate(
    table: SampleTable,
    model: ModelSpec,
    module: str,
    groups: Sequence[Sequence[int] | np.ndarray],
    seconds: Sequence[float] | np.ndarray,
    *,
    phase: str = "forward",
    hardware: Hardware | None = None,
    previous: Calibration | None = None,
) -> Calibration:
    """Fit ``module``'s scales to measured times and return the (merged) calibration.

    ``groups[g]`` are the table rows run together in measurement ``g`` (a
    microbatch), ``seconds[g]`` its measured time: the forward of the whole
    module (``phase="forward"``) or forward + backward (``phase="step"``). The
    fit error is in the returned :class:`ModuleFit` (``rel_rms``, ``r2``).
    """
    if phase not in ("forward", "step"):
        raise InvalidInput(f"calibrate: phase must be 'forward' or 'step', got {phase!r}")
    if len(groups) != len(seconds):
        raise InvalidInput(f"calibrate: {len(groups)} groups but {len(seconds)} measured times")
    lin, att = module_features(table, model, module, hardware)
    cfg = model.module(module)
    mult = 1.0
    if phase == "step":
        mult = (
            1.0 + (0.0 if cfg.frozen else 2.0)
            if cfg.is_encoder
            else 1.0 + (1.0 if cfg.frozen else 2.0)
        )
    xl = np.empty(len(groups))
    xa = np.empty(len(groups))
    for g, idx in enumerate(groups):
        ix = np.asarray(idx, dtype=np.int64)
        if ix.size and (ix.min() < 0 or ix.max() >= len(table)):
            raise InvalidInput(f"calibrate: group {g} has a row index outside 0..{len(table) - 1}")
        xl[g] = lin[ix].sum() * mult
        xa[g] = att[ix].sum() * mult
    fit = fit_coefficients(xl, xa, np.asarray(seconds, dtype=np.float64), phase=phase)
    name = "llm" if cfg.kind == "llm" else cfg.name
    hw = hardware or H100_BF16
    new = Calibration(modules={name: fit}, hardware=hw.name)
    return previous.merged(new) if previous else new
