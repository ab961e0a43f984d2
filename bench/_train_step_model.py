"""The MLLM that ``bench/train_step.py`` times, built from the cost model's module configs.

Why not ``adapters/reference_model.py``: that model has a single encoder block,
no patch merger, no GQA or SwiGLU, and attends over the whole packed sequence
with one dense [T, T] mask, so its attention cost is quadratic in the packed
length rather than per image / per sample. Timing it would not test the cost
model's per-sequence attention terms, and a dense mask over tens of thousands of
tokens does not fit in memory. This model follows a :class:`ModuleConfig`
exactly (layers, hidden, FFN, heads, KV heads, head dim, gated MLP, window
layers, merge factor, vocab, tied head), so the cost model and the real model
count the same tokens and the same FLOPs.

Variable-length attention without flash-attn: segments (images, windows,
packed samples) of equal length are gathered into one batched
``scaled_dot_product_attention`` call per distinct length (PyTorch's own flash /
memory-efficient kernels on a GPU). Index plans are built before timing.
Positional encodings are omitted: they do not change the cost being measured.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from entrain_data.metadata import SampleTable
from entrain_data.presets import ModuleConfig
from entrain_data.tokens import audio_tokens, smart_resize

__all__ = [
    "SegmentPlan",
    "VisionTower",
    "AudioTower",
    "AudioInputs",
    "build_audio_inputs",
    "DecoderLLM",
    "lm_loss_sum",
    "VisionInputs",
    "LLMInputs",
    "MicrobatchInputs",
    "item_grids",
    "window_lengths",
    "build_vision_inputs",
    "build_llm_inputs",
]


@dataclass(frozen=True)
class SegmentPlan:
    """Where the segments of a packed sequence are, grouped by length for batched attention.

    ``groups`` holds ``(length, count, index)``: ``index`` is None when the group is
    one contiguous run (no gather needed), else the [count * length] token rows.
    ``inverse`` puts the concatenated group outputs back in token order (None when
    the groups already are in order).
    """

    total: int
    groups: tuple[tuple[int, int, torch.Tensor | slice], ...]
    inverse: torch.Tensor | None

    @classmethod
    def build(cls, lengths: Sequence[int], device: torch.device) -> SegmentPlan:
        starts, pos = [], 0
        for n in lengths:
            starts.append(pos)
            pos += int(n)
        by_len: dict[int, list[int]] = defaultdict(list)
        for s, n in zip(starts, lengths):
            if n > 0:
                by_len[int(n)].append(s)
        groups: list[tuple[int, int, torch.Tensor | slice]] = []
        order: list[torch.Tensor] = []
        for n, st in by_len.items():
            idx = (torch.tensor(st, dtype=torch.int64)[:, None] + torch.arange(n)).reshape(-1)
            order.append(idx)
            contiguous = len(st) == 1 or all(b - a == n for a, b in zip(st, st[1:]))
            ref = slice(st[0], st[0] + n * len(st)) if contiguous else idx.to(device)
            groups.append((n, len(st), ref))
        flat = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
        in_order = bool((flat == torch.arange(len(flat))).all())
        inverse = None if in_order else torch.argsort(flat).to(device)
        return cls(total=pos, groups=tuple(groups), inverse=inverse)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan, causal: bool
) -> torch.Tensor:
    """Attention within each segment: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    outs = []
    if q.shape[1] != k.shape[1]:  # GQA: expand KV heads (flash/efficient kernels, any torch)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    for n, count, ref in plan.groups:
        qq, kk, vv = (x[ref] for x in (q, k, v))
        qq, kk, vv = (
            x.reshape(count, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (qq, kk, vv)
        )
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        outs.append(o.transpose(1, 2).reshape(count * n, q.shape[1], q.shape[2]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if plan.inverse is None else out[plan.inverse]


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (bf16 weights on a GPU)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Block(nn.Module):
    """Pre-norm transformer layer shaped by a ModuleConfig (GQA, gated or GELU MLP)."""

    def __init__(self, cfg: ModuleConfig, qkv_bias: bool):
        super().__init__()
        h, d = cfg.hidden, cfg.dim_head
        self.heads, self.kv_heads, self.dim = cfg.heads, cfg.kv_heads, d
        self.norm1 = RMSNorm(h)
        self.qkv = nn.Linear(h, (cfg.heads + 2 * cfg.kv_heads) * d, bias=qkv_bias)
        self.proj = nn.Linear(cfg.heads * d, h, bias=qkv_bias)
        self.norm2 = RMSNorm(h)
        self.gated = cfg.gated_mlp
        self.up = nn.Linear(h, (2 if cfg.gated_mlp else 1) * cfg.ffn, bias=qkv_bias)
        self.down = nn.Linear(cfg.ffn, h, bias=qkv_bias)

    def forward(self, x: torch.Tensor, plan: SegmentPlan, causal: bool) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split(
            [self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim], dim=-1
        )
        a = varlen_attention(
            q.view(t, self.heads, self.dim),
            k.view(t, self.kv_heads, self.dim),
            v.view(t, self.kv_heads, self.dim),
            plan,
            causal,
        )
        x = x + self.proj(a.reshape(t, -1))
        u = self.up(self.norm2(x))
        if self.gated:
            g, u = u.chunk(2, dim=-1)
            u = F.silu(g) * u
        else:
            u = F.gelu(u)
        return x + self.down(u)


def _run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    plans: Sequence[SegmentPlan],
    causal: bool,
    recompute: bool,
) -> torch.Tensor:
    for layer, plan in zip(layers, plans):
        if recompute and torch.is_grad_enabled():
            x = checkpoint(layer, x, plan, causal, use_reentrant=False)
        else:
            x = layer(x, plan, causal)
    return x


class VisionTower(nn.Module):
    """Qwen2-VL-style ViT: linear patch embedding, window / full layers, 2x2 merger to the LLM.

    Patches arrive in window order with each merge unit's patches adjacent (as
    Qwen2.5-VL reorders them), so windows and images are contiguous segments.
    """

    def __init__(self, cfg: ModuleConfig, llm_hidden: int, recompute: bool = False):
        super().__init__()
        if cfg.kind != "vision":
            raise ValueError(f"VisionTower needs a vision ModuleConfig, got {cfg.kind!r}")
        self.cfg, self.recompute = cfg, recompute
        self.patch_dim = cfg.in_channels * cfg.temporal_patch * cfg.patch_size**2
        self.embed = nn.Linear(self.patch_dim, cfg.hidden, bias=False)
        self.layers = nn.ModuleList(Block(cfg, qkv_bias=True) for _ in range(cfg.layers))
        self.window = cfg.window_layer_mask()
        d_in = cfg.hidden * cfg.merge**2
        self.merge_norm = RMSNorm(cfg.hidden)
        self.merger = nn.Sequential(nn.Linear(d_in, d_in), nn.GELU(), nn.Linear(d_in, llm_hidden))

    def forward(
        self, patches: torch.Tensor, full: SegmentPlan, windows: SegmentPlan
    ) -> torch.Tensor:
        """[P, patch_dim] -> [P / merge^2, llm_hidden]."""
        x = self.embed(patches)
        plans = [windows if w else full for w in self.window]
        x = _run_layers(self.layers, x, plans, causal=False, recompute=self.recompute)
        x = self.merge_norm(x).reshape(-1, self.cfg.hidden * self.cfg.merge**2)
        return self.merger(x)

    def forward_inputs(self, v: VisionInputs) -> torch.Tensor:
        return self(v.patches, v.full, v.windows)


class AudioTower(nn.Module):
    """Whisper-style encoder: conv stem over padded windows of log-mel frames, full attention
    within each window, average pooling, linear projector; output trimmed to each clip's
    real length (the LLM sees only those tokens, as the cost model counts them)."""

    def __init__(self, cfg: ModuleConfig, llm_hidden: int, recompute: bool = False):
        super().__init__()
        if cfg.kind != "audio":
            raise ValueError(f"AudioTower needs an audio ModuleConfig, got {cfg.kind!r}")
        self.cfg, self.recompute = cfg, recompute
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.hidden, 3, padding=1)
        self.conv2 = nn.Conv1d(cfg.hidden, cfg.hidden, 3, stride=cfg.audio_conv_stride, padding=1)
        self.layers = nn.ModuleList(Block(cfg, qkv_bias=True) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.projector = nn.Linear(cfg.hidden, llm_hidden)

    def forward(self, mels: torch.Tensor, plan: SegmentPlan, keep: torch.Tensor) -> torch.Tensor:
        """[W, n_mels, frames] windows -> [len(keep), llm_hidden]."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mels))))  # [W, hidden, seq]
        x = x.transpose(1, 2).reshape(-1, self.cfg.hidden)
        x = _run_layers(self.layers, x, [plan] * len(self.layers), False, self.recompute)
        x = self.norm(x)
        w, p = mels.shape[0], self.cfg.audio_pool
        if p > 1:
            x = x.view(w, -1, self.cfg.hidden)
            x = F.avg_pool1d(x.transpose(1, 2), p, p).transpose(1, 2).reshape(-1, self.cfg.hidden)
        return self.projector(x[keep])

    def forward_inputs(self, a: AudioInputs) -> torch.Tensor:
        return self(a.mels, a.plan, a.keep)


class DecoderLLM(nn.Module):
    """Llama-style decoder over a packed sequence (causal attention within each sample)."""

    def __init__(self, cfg: ModuleConfig, recompute: bool = False, loss_chunk: int = 8192):
        super().__init__()
        if cfg.kind != "llm":
            raise ValueError(f"DecoderLLM needs an llm ModuleConfig, got {cfg.kind!r}")
        self.cfg, self.recompute, self.loss_chunk = cfg, recompute, loss_chunk
        self.tok_embed = nn.Embedding(cfg.vocab, cfg.hidden)
        nn.init.normal_(self.tok_embed.weight, std=0.02)  # Llama's init; N(0, 1) gives huge logits
        self.layers = nn.ModuleList(Block(cfg, qkv_bias=False) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        media: torch.Tensor,
        media_mask: torch.Tensor,
        plan: SegmentPlan,
    ) -> torch.Tensor:
        """Mean next-token loss; ``media`` [sum(mask), hidden] replaces the placeholder rows."""
        x = self.tok_embed(input_ids)
        if media.shape[0]:
            x = x.masked_scatter(media_mask[:, None], media.to(x.dtype))
        x = _run_layers(self.layers, x, [plan] * len(self.layers), True, self.recompute)
        x = self.norm(x)
        weight = self.tok_embed.weight if self.lm_head is None else self.lm_head.weight
        count = (labels != -100).sum().clamp(min=1)
        return lm_loss_sum(x, weight, labels, self.loss_chunk) / count


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (h @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def lm_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Summed cross-entropy over chunks of tokens, recomputing each chunk's logits in backward:
    a 128k vocabulary over tens of thousands of packed tokens would not fit otherwise."""
    if hidden.shape[0] <= chunk:  # one chunk: nothing to save by recomputing
        return _chunk_loss(hidden, weight, labels)
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s : s + chunk], labels[s : s + chunk]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, h, weight, y, use_reentrant=False)
        else:
            total = total + _chunk_loss(h, weight, y)
    return total


# ------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class VisionInputs:
    """Random patches of an encoder set's images, its segment plans, a gradient for backward."""

    patches: torch.Tensor
    full: SegmentPlan
    windows: SegmentPlan
    grad_out: torch.Tensor


@dataclass(frozen=True)
class LLMInputs:
    """Packed token ids of an LLM set with placeholders for the vision tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    media: torch.Tensor
    media_mask: torch.Tensor
    plan: SegmentPlan


@dataclass(frozen=True)
class AudioInputs:
    """Random log-mel windows of an encoder set's clips and which pooled tokens are real."""

    mels: torch.Tensor
    plan: SegmentPlan
    keep: torch.Tensor
    grad_out: torch.Tensor


@dataclass(frozen=True)
class MicrobatchInputs:
    """One microbatch: inputs of every encoder (None where its set has no item) and the LLM."""

    encoders: tuple[VisionInputs | AudioInputs | None, ...]
    llm: LLMInputs | None


def item_grids(table: SampleTable, cfg: ModuleConfig) -> np.ndarray:
    """[K, 3] (temporal groups, patch rows, patch cols) of every vision item of ``table``.

    Mirrors ``entrain_data.tokens.vision_tokens`` (dynamic resolution) so the
    model sees the token counts the cost model prices.
    """
    if cfg.resize != "dynamic":
        raise ValueError(f"bench model supports dynamic-resolution encoders, not {cfg.resize!r}")
    frames = table.image_frames.astype(np.int64)
    is_video = frames > 1
    vcap = np.full(frames.shape, float(min(cfg.video_max_pixels or cfg.max_pixels, cfg.max_pixels)))
    if cfg.video_total_pixels:
        vcap = np.minimum(vcap, cfg.video_total_pixels / frames * cfg.temporal_patch)
    vcap = np.maximum(vcap, cfg.min_pixels)
    max_px = np.where(is_video, vcap, cfg.max_pixels)
    hb, wb = smart_resize(
        table.image_height, table.image_width, cfg.patch_size * cfg.merge, cfg.min_pixels, max_px
    )
    groups = -(-frames // cfg.temporal_patch)
    return np.stack([groups, hb // cfg.patch_size, wb // cfg.patch_size], axis=1)


def _chunks(n: int, k: int) -> list[int]:
    return [k] * (n // k) + ([n % k] if n % k else [])


def window_lengths(gh: int, gw: int, cfg: ModuleConfig) -> list[int]:
    """Patch counts of the attention windows of one frame group (row-major windows)."""
    m = cfg.merge
    if cfg.window_patches <= 0:
        return [gh * gw]
    k = max(cfg.window_patches // m, 1)
    return [r * c * m * m for r in _chunks(gh // m, k) for c in _chunks(gw // m, k)]


def build_vision_inputs(
    table: SampleTable,
    cfg: ModuleConfig,
    grids: np.ndarray,
    rows: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    llm_hidden: int,
) -> VisionInputs | None:
    """Inputs of the encoder for the samples ``rows`` (None when they carry no image)."""
    full: list[int] = []
    wins: list[int] = []
    off = table.image_offsets
    for i in rows:
        for t, gh, gw in grids[off[i] : off[i + 1]]:
            for _ in range(int(t)):
                full.append(int(gh * gw))
                wins.extend(window_lengths(int(gh), int(gw), cfg))
    total = sum(full)
    if total == 0:
        return None
    patch_dim = cfg.in_channels * cfg.temporal_patch * cfg.patch_size**2
    patches = torch.randn(total, patch_dim, generator=gen, device=gen.device)
    grad = torch.randn(total // cfg.merge**2, llm_hidden, generator=gen, device=gen.device)
    return VisionInputs(
        patches=patches.to(device=device, dtype=dtype),
        full=SegmentPlan.build(full, device),
        windows=SegmentPlan.build(wins, device),
        grad_out=(grad * 1e-3).to(device=device, dtype=dtype),
    )


def build_audio_inputs(
    table: SampleTable,
    cfg: ModuleConfig,
    rows: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    llm_hidden: int,
) -> AudioInputs | None:
    """Inputs of the audio encoder for the samples ``rows`` (None when they carry no audio)."""
    off = table.audio_offsets
    items = np.concatenate([np.arange(off[i], off[i + 1]) for i in rows] or [np.zeros(0, int)])
    if len(items) == 0:
        return None
    tok = audio_tokens(cfg, table.audio_seconds[items])
    frames = int(round(cfg.audio_window_seconds * cfg.audio_frame_rate))
    seq = int(tok.seq_len[0])
    pooled = seq // cfg.audio_pool
    keep, base = [], 0
    for n_win, n_llm in zip(tok.n_seq, tok.llm_tokens):
        keep.append(base + np.arange(min(int(n_llm), int(n_win) * pooled)))
        base += int(n_win) * pooled
    keep_t = torch.from_numpy(np.concatenate(keep)).to(device)
    n_win = int(tok.n_seq.sum())
    mels = torch.randn(n_win, cfg.n_mels, frames, generator=gen, device=gen.device)
    grad = torch.randn(len(keep_t), llm_hidden, generator=gen, device=gen.device) * 1e-3
    return AudioInputs(
        mels=mels.to(device=device, dtype=dtype),
        plan=SegmentPlan.build([seq] * n_win, device),
        keep=keep_t,
        grad_out=grad.to(device=device, dtype=dtype),
    )


def build_llm_inputs(
    cfg: ModuleConfig,
    llm_tokens: np.ndarray,
    media_tokens: np.ndarray,
    rows: np.ndarray,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> LLMInputs | None:
    """Packed ids for the samples ``rows``: a BOS, the media placeholders, then text.

    Random draws happen on ``gen``'s device (the GPU in GPU runs: no host copies).
    """
    lens = [int(llm_tokens[i]) for i in rows]
    total = sum(lens)
    if total == 0:
        return None
    mask_np = np.zeros(total, dtype=bool)
    last = np.cumsum(lens) - 1
    for start, i in zip(last + 1 - np.array(lens), rows):
        mask_np[start + 1 : start + 1 + int(media_tokens[i])] = True
    media_mask = torch.from_numpy(mask_np).to(gen.device)
    ids = torch.randint(3, cfg.vocab, (total,), generator=gen, device=gen.device)
    ids[media_mask] = 1
    labels = torch.full_like(ids, -100)
    labels[:-1] = ids[1:]
    labels[torch.from_numpy(last).to(gen.device)] = -100  # no target across samples
    labels[:-1][media_mask[1:]] = -100
    media = torch.randn(int(mask_np.sum()), cfg.hidden, generator=gen, device=gen.device)
    return LLMInputs(
        input_ids=ids.to(device),
        labels=labels.to(device),
        media=media.to(device=device, dtype=dtype).requires_grad_(True),
        media_mask=media_mask.to(device),
        plan=SegmentPlan.build(lens, device),
    )
