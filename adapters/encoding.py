"""How the reference model's encoder calls are grouped, per microbatch and consuming microbatch.

Without group-wide calls (:func:`encode_into_buffer`): one encoder call for the
samples the LLM consumes here, one per later consumer for deferred samples,
so every graph's backward runs exactly once, with its consumer's. With them
(:func:`encode_uniform`, for sharded data parallelism): exactly the calls that
``mb.meta["encoder_calls"]`` lists, padded where this rank has nothing to
encode (see :mod:`entrain_data.encoder_calls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..batch import Microbatch
from ..encoder_calls import ENCODER_CALLS_KEY
from ..errors import InvalidInput
from .common import EncoderOutputBuffer


class EncodingModel(Protocol):
    """What the grouping needs of a model (:class:`~.reference_model.ReferenceMLLM` has it)."""

    config: Any
    tok_embed: torch.nn.Embedding

    def encode(
        self, mb: Microbatch, keys: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]: ...

    def encode_kind(
        self, mb: Microbatch, kind: str, keys: Sequence[str]
    ) -> dict[str, torch.Tensor]: ...

    def pad_call(self, kind: str, device: torch.device) -> torch.Tensor: ...


__all__ = ["ENCODERS", "ENCODER_TENSORS", "EncodingModel", "encode_into_buffer", "encode_uniform"]

ENCODERS = ("vision", "audio")
"""The reference model's encoders, in call order (the names of ``mb.meta["encoder_calls"]``)."""
ENCODER_TENSORS = {
    "vision": ("pixel_values", "image_grid_thw", "image_sample"),
    "audio": ("audio_features", "audio_lengths", "audio_sample"),
}
"""Per encoder: its feature tensor, item sizes and item owner (``batch.py`` names)."""
ENCODER_ITEMS = {
    "vision": (("pixel_values", "image_sample"), ("pixel_values_videos", "video_sample")),
    "audio": (("audio_features", "audio_sample"),),
}
"""Per encoder, every ``(features, owner)`` pair it takes items from: video clips are vision
items too, as the loader service counts them (:data:`.common.ENCODER_OWNERS`)."""


def encode_into_buffer(
    model: EncodingModel, mb: Microbatch, buffer: EncoderOutputBuffer
) -> dict[str, torch.Tensor]:
    """Encode ``mb``'s encoder set; park deferred outputs in ``buffer``; return the LLM set's outputs.

    Samples consumed here share one encoder graph; deferred samples share one
    per consuming microbatch (when ``buffer.expect`` announced it, else one
    each), so every graph's backward runs exactly once, with its consumer's.
    """
    out_keys = set(mb.deferred_out)
    here = [k for k in mb.encoder_keys if k not in out_keys]
    encoded = model.encode(mb, here) if here else {}
    groups: dict[object, list[str]] = {}
    for key in mb.deferred_out:
        target = buffer.consumer(key, mb.iteration)
        groups.setdefault(key if target is None else target, []).append(key)
    for keys in groups.values():
        for key, out in model.encode(mb, keys).items():
            buffer.put(key, out, iteration=mb.iteration)
    for key in mb.deferred_in:
        encoded[key] = buffer.pop(key, iteration=mb.iteration)
    return encoded


def _has_items(mb: Microbatch, kind: str, keys: Sequence[str]) -> bool:
    if not keys:
        return False
    pos = {k: i for i, k in enumerate(mb.encoder_keys)}
    wanted = {pos[k] for k in keys}
    return any(
        feats in mb and owner in mb and set(mb[owner].tolist()) & wanted
        for feats, owner in ENCODER_ITEMS[kind]
    )


def encode_uniform(
    model: EncodingModel,
    mb: Microbatch,
    buffer: EncoderOutputBuffer,
    calls: dict[str, list[int]],
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Encode ``mb``'s encoder set making exactly the group-wide ``calls`` (see
    :mod:`entrain_data.encoder_calls`): for each consumer microbatch c in order, each encoder
    in :data:`ENCODERS` order, one call on the group's items or a pad call when it has none.
    Returns the LLM set's outputs and the pad outputs consumed here (they enter the loss
    times zero); pads for a later consumer wait in ``buffer``, as deferred outputs do.
    """
    j, it = mb.microbatch, mb.iteration
    out_keys = set(mb.deferred_out)
    groups: dict[int, list[str]] = {j: [k for k in mb.encoder_keys if k not in out_keys]}
    for key in mb.deferred_out:
        c = buffer.consumer(key, it)
        if c is None:
            raise InvalidInput(
                f"sample {key!r} deferred from microbatch {j} (iteration {it}) has no announced "
                "consumer: call buffer.expect(microbatches) before the step"
            )
        groups.setdefault(c, []).append(key)
    for c, keys in groups.items():
        for kind in ENCODERS:
            if c not in calls.get(kind, ()) and _has_items(mb, kind, keys):
                raise InvalidInput(
                    f"microbatch {j} (iteration {it}): mb.meta[{ENCODER_CALLS_KEY!r}] lists no "
                    f"{kind} call for consumer {c}, but samples {keys[:3]} have {kind} items"
                )
    encoded: dict[str, torch.Tensor] = {}
    pads: list[torch.Tensor] = []
    device = mb["input_ids"].device if "input_ids" in mb else torch.device("cpu")
    empty = model.tok_embed.weight.new_zeros(0, model.config.hidden)
    for c in sorted({c for kind in ENCODERS for c in calls.get(kind, ())}):
        keys = groups.get(c, [])
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for kind in ENCODERS:
            if c not in calls.get(kind, ()):
                continue
            out = model.encode_kind(mb, kind, keys)
            if not out:  # this rank has no such items for c: a pad call keeps the collectives
                pad = model.pad_call(kind, device)
                if c == j:
                    pads.append(pad)
                else:
                    buffer.put_pad(c, pad, iteration=it)
            for key, o in out.items():
                parts[key].append(o)
        for key, p in parts.items():
            joined = torch.cat(p) if p else empty
            if c == j:
                encoded[key] = joined
            else:
                buffer.put(key, joined, iteration=it)
    for key in mb.deferred_in:
        encoded[key] = buffer.pop(key, iteration=it)
    pads.extend(buffer.pop_pads(j, iteration=it))
    return encoded, pads
