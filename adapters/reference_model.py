"""A tiny vision + audio encoder and decoder LLM that consumes :class:`~entrain_data.batch.Microbatch`.

Small enough to train on CPU in tests, examples and the demo, yet shaped like a
real MLLM so the adapters are exercised for real: a ViT-like vision encoder over
flattened patches (attention within each image, Qwen2-VL layout), an audio
encoder over log-mel frames (attention within each clip), both projected to the
LLM width and scattered into the placeholder positions of ``input_ids``, and a
decoder LLM with packed causal attention (one causal block per sample, from
``cu_seqlens``) that returns ``(loss_sum, loss_count)``.

Placeholder ids come from ``mb.meta["image_token_id"]`` / ``mb.meta["audio_token_id"]``,
defaulting to :data:`IMAGE_TOKEN_ID` / :data:`AUDIO_TOKEN_ID`. One encoder output
token per patch and per audio frame (no merging), so a sample's placeholders
number the patches of its images and the frames of its clips.

Deferral: :meth:`ReferenceMLLM.forward` takes an
:class:`~entrain_data.adapters.common.EncoderOutputBuffer`; samples encoded here
whose LLM part runs later are stored there with their autograd graph, and the
microbatch that consumes them backpropagates into the encoder (split backward).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..batch import Microbatch
from ..encoder_calls import ENCODER_CALLS_KEY
from ..errors import InvalidInput
from ..plan import ParallelPlan
from .common import EncoderOutputBuffer, loss_sums
from .encoding import ENCODER_TENSORS, ENCODERS, encode_into_buffer, encode_uniform

__all__ = [
    "IMAGE_TOKEN_ID",
    "AUDIO_TOKEN_ID",
    "ReferenceConfig",
    "ReferenceMLLM",
    "SyntheticSample",
    "synthetic_samples",
    "pack_microbatch",
    "packed_causal_mask",
    "synthetic_stream",
]

log = logging.getLogger(__name__)

IMAGE_TOKEN_ID = 1
"""Default placeholder id of a vision output token in ``input_ids``."""
AUDIO_TOKEN_ID = 2
"""Default placeholder id of an audio output token in ``input_ids``."""


@dataclass(frozen=True)
class ReferenceConfig:
    """Sizes of the reference model (defaults: a few thousand parameters, fast on CPU)."""

    vocab: int = 48
    hidden: int = 16
    heads: int = 2
    llm_layers: int = 4
    patch_dim: int = 12
    vision_hidden: int = 16
    n_mels: int = 8
    audio_hidden: int = 16


def _block_mask(
    lengths: Sequence[int] | torch.Tensor, causal: bool, device: torch.device
) -> torch.Tensor:
    """Boolean [T, T] attention mask: each token sees only its own segment (and, if causal,
    only earlier tokens of it); the packed sequence is attended in one call."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    mask = owner[:, None] == owner[None, :]
    if causal:
        mask = mask.tril()
    return mask


def packed_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [T, T] of a packed sequence (one causal block per sample)."""
    return _block_mask(torch.diff(cu_seqlens.long()), causal=True, device=cu_seqlens.device)


class Segments:
    """Segment lengths of a packed sequence (+ causality): attention runs per segment, so its cost
    is the sum of squared segment lengths, not the square of the packed length.

    Not a tuple subclass on purpose: frameworks that walk module inputs and rebuild
    tuples (DeepSpeed ZeRO-3's ``apply_to_tensors_only``) would drop ``causal``.
    """

    __slots__ = ("lengths", "causal")

    def __init__(self, lengths: Sequence[int], causal: bool):
        self.lengths = tuple(int(n) for n in lengths)
        self.causal = bool(causal)

    def __iter__(self) -> Iterator[int]:
        return iter(self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __repr__(self) -> str:
        return f"Segments({list(self.lengths)}, causal={self.causal})"


class _Block(nn.Module):
    """Pre-norm transformer block over a packed sequence; ``mask`` (a [T, T] boolean mask or
    :class:`Segments`) keeps segments apart."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | Segments) -> torch.Tensor:
        t, h = x.shape
        q, k, v = (
            self.qkv(self.norm1(x)).view(t, 3, self.heads, h // self.heads).permute(1, 2, 0, 3)
        )
        if isinstance(mask, Segments):
            parts, start = [], 0
            for n in mask:
                sl = slice(start, start + n)
                parts.append(
                    F.scaled_dot_product_attention(
                        q[:, sl], k[:, sl], v[:, sl], is_causal=mask.causal
                    )
                )
                start += n
            attn = torch.cat(parts, dim=1) if parts else q
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [heads, t, d]
        x = x + self.proj(attn.transpose(0, 1).reshape(t, h))
        return x + self.mlp(self.norm2(x))


class _Encoder(nn.Module):
    """Input projection, one bidirectional block within each item, projector to the LLM width."""

    def __init__(self, in_dim: int, hidden: int, heads: int, out_dim: int):
        super().__init__()
        self.embed = nn.Linear(in_dim, hidden)
        self.block = _Block(hidden, heads)
        self.projector = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor, item_lengths: Sequence[int]) -> torch.Tensor:
        x = x.to(self.embed.weight.dtype)  # bf16 runs: features arrive in fp32
        return self.projector(self.block(self.embed(x), Segments(item_lengths, causal=False)))


class ReferenceMLLM(nn.Module):
    """Vision + audio encoders and a decoder LLM; ``forward(mb, buffer) -> (loss_sum, loss_count)``.

    The pieces are separate methods so pipeline adapters can cut the model:
    :meth:`encode` (encoder set -> per-sample outputs), :meth:`embed` (LLM set
    tokens with encoder outputs scattered in), ``layers[i]`` and :meth:`head_loss`.
    """

    def __init__(self, config: ReferenceConfig | None = None):
        super().__init__()
        c = self.config = config or ReferenceConfig()
        self.vision = _Encoder(c.patch_dim, c.vision_hidden, c.heads, c.hidden)
        self.audio = _Encoder(c.n_mels, c.audio_hidden, c.heads, c.hidden)
        self.tok_embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(_Block(c.hidden, c.heads) for _ in range(c.llm_layers))
        self.norm = nn.LayerNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    # ------------------------------------------------------------ encoders
    def encode(self, mb: Microbatch, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Encoder outputs ``{key: [n_vision + n_audio, hidden]}`` for ``keys`` (default: the encoder set).

        Rows are the sample's vision tokens (items in order) then its audio
        tokens. Running only a subset lets deferred samples get a graph of
        their own, so their encoder backward runs alone when their gradient arrives.
        """
        keys = list(mb.encoder_keys if keys is None else keys)
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for kind in ENCODERS:
            for key, out in self.encode_kind(mb, kind, keys).items():
                parts[key].append(out)
        empty = self.tok_embed.weight.new_zeros(0, self.config.hidden)
        return {k: torch.cat(v) if v else empty for k, v in parts.items()}

    def encode_kind(
        self, mb: Microbatch, kind: str, keys: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """One call of encoder ``kind`` on the items of ``keys``: ``{key: [rows, hidden]}`` for the
        keys that have such items (nothing, and no call, when none has)."""
        enc = getattr(self, kind)
        feats, sizes, owner = ENCODER_TENSORS[kind]
        if feats not in mb:
            return {}
        pos = {k: i for i, k in enumerate(mb.encoder_keys)}
        wanted = {pos[k] for k in keys}
        lengths = (mb[sizes].prod(dim=1) if kind == "vision" else mb[sizes]).tolist()
        owners = mb[owner].tolist()
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
        sel = [i for i, o in enumerate(owners) if o in wanted]
        if not sel:
            return {}
        x = torch.cat([mb[feats][starts[i] : starts[i + 1]] for i in sel])
        out = enc(x, [lengths[i] for i in sel]).split([lengths[i] for i in sel])
        parts: dict[str, list[torch.Tensor]] = {}
        for i, o in zip(sel, out):
            parts.setdefault(mb.encoder_keys[owners[i]], []).append(o)
        return {k: torch.cat(v) for k, v in parts.items()}

    def pad_call(self, kind: str, device: torch.device) -> torch.Tensor:
        """A call of encoder ``kind`` on one zero row: same collectives as a real call under
        sharded data parallelism; its output enters the loss times zero (no gradient)."""
        enc = getattr(self, kind)
        return enc(torch.zeros(1, enc.embed.in_features, device=device), [1])

    def dummy_touch(self) -> torch.Tensor:
        """Zero that depends on every encoder parameter: keeps DDP/ZeRO hooks firing in
        microbatches without images or audio (the usual MLLM training trick)."""
        return sum(p.sum() for m in (self.vision, self.audio) for p in m.parameters()) * 0.0

    # ----------------------------------------------------------------- LLM
    def embed(self, mb: Microbatch, encoded: dict[str, torch.Tensor]) -> torch.Tensor:
        """Token embeddings of the LLM set with each sample's encoder outputs at its placeholders."""
        ids = mb["input_ids"]
        image_id = int(mb.meta.get("image_token_id", IMAGE_TOKEN_ID))
        audio_id = int(mb.meta.get("audio_token_id", AUDIO_TOKEN_ID))
        x = self.tok_embed(ids)
        is_img, is_aud = ids == image_id, ids == audio_id
        if not bool((is_img | is_aud).any()):
            return x
        cu = mb["cu_seqlens"].tolist()
        img_rows, aud_rows = [], []
        for i, key in enumerate(mb.llm_keys):
            n_img = int(is_img[cu[i] : cu[i + 1]].sum())
            n_aud = int(is_aud[cu[i] : cu[i + 1]].sum())
            if n_img + n_aud == 0:
                continue
            out = encoded.get(key)
            if out is None or out.shape[0] != n_img + n_aud:
                got = "nothing" if out is None else f"{out.shape[0]} tokens"
                raise InvalidInput(
                    f"sample {key!r}: {n_img + n_aud} encoder placeholders in input_ids but {got} "
                    f"of encoder output (iteration {mb.iteration}, microbatch {mb.microbatch})"
                )
            img_rows.append(out[:n_img])
            aud_rows.append(out[n_img:])
        for mask, rows in ((is_img, img_rows), (is_aud, aud_rows)):
            if bool(mask.any()):
                x = x.masked_scatter(mask[:, None], torch.cat(rows).to(x.dtype))
        return x

    @staticmethod
    def llm_mask(mb: Microbatch) -> torch.Tensor:
        """Block-diagonal causal mask of the packed LLM set (from ``cu_seqlens``)."""
        return _block_mask(
            torch.diff(mb["cu_seqlens"].long()), causal=True, device=mb["input_ids"].device
        )

    def head_loss(
        self, hidden: torch.Tensor, mb: Microbatch, mode: str = "token"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, loss_count)`` of the LLM set (see :func:`~.common.loss_sums`)."""
        logits = self.lm_head(self.norm(hidden))
        return loss_sums(logits, mb["labels"], mb["cu_seqlens"], mode)

    def embed_microbatch(self, mb: Microbatch, buffer: EncoderOutputBuffer) -> torch.Tensor:
        """``[T, hidden]`` LLM input of ``mb``: its encoder set encoded (deferred outputs parked
        in ``buffer``, earlier ones taken from it) and scattered into the token embeddings.
        The first pipeline stage of every adapter runs exactly this."""
        calls = mb.meta.get(ENCODER_CALLS_KEY)
        if calls is None:
            encoded = encode_into_buffer(self, mb, buffer)
            return self.embed(mb, encoded) + self.dummy_touch()
        # group-wide calls (sharded data parallelism): pads replace the dummy touch, which
        # would read parameters that ZeRO-3 / FSDP2 hold sharded outside a module's forward
        encoded, pads = encode_uniform(self, mb, buffer, calls)
        return self.embed(mb, encoded) + sum(p.sum() for p in pads) * 0.0

    def forward(
        self, mb: Microbatch, buffer: EncoderOutputBuffer | None = None, mode: str = "token"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the encoder set, run the LLM on the LLM set; ``(loss_sum, loss_count)``."""
        x = self.embed_microbatch(mb, buffer if buffer is not None else EncoderOutputBuffer())
        mask = Segments(torch.diff(mb["cu_seqlens"].long()).tolist(), causal=True)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head_loss(x, mb, mode)


# ------------------------------------------------------ synthetic data (tests, examples)
@dataclass(frozen=True)
class SyntheticSample:
    """One sample: text ids with placeholders, its images (patches, grids) and audio clips."""

    key: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    patches: torch.Tensor  # [P, patch_dim]
    grids: torch.Tensor  # [I, 3]
    audio: torch.Tensor  # [F, n_mels]
    audio_lengths: torch.Tensor  # [C]

    @property
    def encoder_tokens(self) -> int:
        return int(self.patches.shape[0] + self.audio.shape[0])

    @property
    def llm_tokens(self) -> int:
        return int(self.input_ids.numel())


def synthetic_samples(
    n: int, seed: int = 0, config: ReferenceConfig | None = None, prefix: str = "s"
) -> list[SyntheticSample]:
    """``n`` random samples of widely varying sizes (text-only, multi-image, audio), deterministic."""
    c = config or ReferenceConfig()
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for i in range(n):
        kind = i % 4
        grids = (
            [[1, randint(1, 4), randint(1, 6)] for _ in range(randint(1, 3))]
            if kind in (0, 1)
            else []
        )
        clips = [randint(3, 12) for _ in range(randint(1, 2))] if kind in (1, 2) else []
        n_vis, n_aud = sum(t * h * w for t, h, w in grids), sum(clips)
        text = randint(4, 40)
        ids = torch.randint(3, c.vocab, (text + n_vis + n_aud,), generator=g)
        ids[1 : 1 + n_vis] = IMAGE_TOKEN_ID
        ids[1 + n_vis : 1 + n_vis + n_aud] = AUDIO_TOKEN_ID
        labels = torch.full_like(ids, -100)
        labels[:-1] = ids[1:]
        labels[ids == IMAGE_TOKEN_ID] = -100
        labels[ids == AUDIO_TOKEN_ID] = -100
        labels[labels < 3] = -100
        out.append(
            SyntheticSample(
                key=f"{prefix}{i:04d}",
                input_ids=ids,
                labels=labels,
                patches=torch.randn(n_vis, c.patch_dim, generator=g),
                grids=torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
                audio=torch.randn(n_aud, c.n_mels, generator=g),
                audio_lengths=torch.tensor(clips, dtype=torch.int64),
            )
        )
    return out


def pack_microbatch(
    samples: dict[str, SyntheticSample],
    encoder_keys: Sequence[str],
    llm_keys: Sequence[str],
    *,
    iteration: int = 0,
    microbatch: int = 0,
    replica: int = 0,
) -> Microbatch:
    """Pack synthetic samples into a :class:`Microbatch` with the tensor names of ``batch.py``."""
    enc = [samples[k] for k in encoder_keys]
    llm = [samples[k] for k in llm_keys]
    lens = [s.llm_tokens for s in llm]
    t: dict[str, torch.Tensor] = {
        "input_ids": torch.cat([s.input_ids for s in llm])
        if llm
        else torch.zeros(0, dtype=torch.int64),
        "labels": torch.cat([s.labels for s in llm]) if llm else torch.zeros(0, dtype=torch.int64),
        "position_ids": torch.cat([torch.arange(n) for n in lens])
        if llm
        else torch.zeros(0, dtype=torch.int64),
        "cu_seqlens": torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32),
        "llm_vision_tokens": torch.tensor(
            [int(s.patches.shape[0]) for s in llm], dtype=torch.int64
        ),
        "llm_audio_tokens": torch.tensor([int(s.audio.shape[0]) for s in llm], dtype=torch.int64),
    }
    if any(s.grids.shape[0] for s in enc):
        t["pixel_values"] = torch.cat([s.patches for s in enc])
        t["image_grid_thw"] = torch.cat([s.grids for s in enc])
        t["image_sample"] = torch.cat(
            [torch.full((s.grids.shape[0],), i, dtype=torch.int64) for i, s in enumerate(enc)]
        )
    if any(s.audio_lengths.numel() for s in enc):
        t["audio_features"] = torch.cat([s.audio for s in enc])
        t["audio_lengths"] = torch.cat([s.audio_lengths for s in enc])
        t["audio_sample"] = torch.cat(
            [
                torch.full((s.audio_lengths.numel(),), i, dtype=torch.int64)
                for i, s in enumerate(enc)
            ]
        )
    meta = {"image_token_id": IMAGE_TOKEN_ID, "audio_token_id": AUDIO_TOKEN_ID}
    return Microbatch(
        0, iteration, microbatch, replica, list(encoder_keys), list(llm_keys), t, meta
    )


def synthetic_stream(
    plan: ParallelPlan,
    replica: int,
    steps: int,
    samples_per_batch: int | None = None,
    seed: int = 0,
) -> Iterator[Microbatch]:
    """Replica ``replica``'s microbatches for ``steps`` iterations of synthetic global batches,
    assigned by Entrain's ``assign()`` as the loader service would (examples, smoke tests)."""
    from ..assignment import assign

    n = samples_per_batch or plan.global_batch
    for it in range(steps):
        batch = synthetic_samples(n, seed=seed + it, prefix=f"i{it}-")
        enc = np.array([s.encoder_tokens**1.5 for s in batch], dtype=float)
        llm = np.array([s.llm_tokens for s in batch], dtype=float)
        tok = np.array([s.llm_tokens for s in batch], dtype=np.int64)
        a = assign(
            enc, llm, tok, dp=plan.dp, microbatches=plan.microbatches, max_tokens=plan.max_tokens,
            defer_budget=plan.defer_budget, method=plan.method, seed=seed, iteration=it,
            pipeline_stages=plan.pp, stage_shares=plan.shares_for(1),
        )  # fmt: skip
        by_key = {s.key: s for s in batch}
        keys = [s.key for s in batch]
        for j in range(plan.microbatches):
            yield pack_microbatch(
                by_key,
                [keys[i] for i in a.encoder_sets[replica][j]],
                [keys[i] for i in a.llm_sets[replica][j]],
                iteration=it,
                microbatch=j,
                replica=replica,
            )
