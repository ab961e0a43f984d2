"""The packed microbatch a rank receives: the one type shared by loader, client and adapters.

A microbatch ``(iteration, microbatch)`` of a replica has two parts (Entrain's
two-layer composition): the *encoder set* (samples whose modality encoders run
in this microbatch; their pixel/audio tensors are here) and the *LLM set*
(samples whose LLM part runs here; their packed token sequence is here). A
sample's LLM part may run in a later microbatch than its encoder part of the
same iteration (deferral); the adapters buffer its encoder output, keyed by the
sample key, in between.

Tensor names (all optional except the LLM part when ``llm_keys`` is non-empty):

- ``input_ids`` int64 [T]: the LLM-set samples packed without padding, in
  ``llm_keys`` order; each encoder output token has a placeholder id
  (``image_token_id`` / ``audio_token_id`` in ``meta``).
- ``labels`` int64 [T]: next-token targets, ``-100`` where no loss is taken.
- ``position_ids`` int64 [T]: positions restarting at 0 for every sample.
- ``cu_seqlens`` int32 [len(llm_keys) + 1]: sample boundaries in the packed sequence.
- ``pixel_values`` float32 [P, D]: flattened patches of every still image of
  the encoder set (Qwen2-VL layout, ``D = C * temporal_patch * p * p``),
  ``image_grid_thw`` int64 [I, 3] the patch grid of each item (InternVL tiles:
  ``(tiles, h, w)``, thumbnail last), ``image_sample`` int64 [I] the owning
  sample's position in ``encoder_keys``.
- ``pixel_values_videos`` float32 [P, D], ``video_grid_thw`` int64 [V, 3],
  ``video_sample`` int64 [V]: the same for video clips (``temporal_patch``
  consecutive sampled frames per patch row), as Qwen2-VL's video processor.

Pixels travel as uint8 (``pixel_values`` [P, C*p*p]: one copy of a still
image's temporal patch; ``pixel_values_videos`` [P, C*tp*p*p]), a quarter to an
eighth of the float bytes; :meth:`Microbatch.to` converts them on the training
device to the float32 tensors above with the encoder's normalisation, which the
packer puts in ``meta``: ``pixel_mean``, ``pixel_std`` (per channel, applied as
``(x / 255 - mean) / std``) and ``temporal_patch``.
- ``audio_features`` float32 [F, n_mels]: log-mel frames of every audio clip,
  concatenated; ``audio_lengths`` int64 [C] frames per clip; ``audio_sample``
  int64 [C] the owner's position in ``encoder_keys``.
- ``llm_vision_tokens`` / ``llm_audio_tokens`` int64 [len(llm_keys)]: encoder
  output tokens each LLM-set sample consumes (placeholders in ``input_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import InvalidInput

if TYPE_CHECKING:  # torch is imported by whoever builds tensors: importing the package stays cheap
    import torch

__all__ = ["Microbatch", "normalize_pixels", "PIXEL_TENSORS"]

PIXEL_TENSORS = ("pixel_values", "pixel_values_videos")


def _uint8() -> Any:
    import torch

    return torch.uint8


def normalize_pixels(x: torch.Tensor, meta: Mapping[str, Any], *, video: bool) -> torch.Tensor:
    """uint8 patch rows [P, C*k*p*p] -> float32 [P, C*tp*p*p], ``(x / 255 - mean) / std``.

    A still image's rows hold one temporal copy (k = 1) and are repeated ``temporal_patch`` times,
    as the reference processors repeat a still image over the temporal patch; a video's rows hold
    their ``temporal_patch`` frames already. Runs where ``x`` lives (the training device).
    """
    import torch

    try:
        mean = torch.tensor(meta["pixel_mean"], dtype=torch.float32, device=x.device)
        std = torch.tensor(meta["pixel_std"], dtype=torch.float32, device=x.device)
        tp = int(meta.get("temporal_patch", 1))
    except KeyError as exc:
        raise InvalidInput(f"uint8 pixels need {exc.args[0]!r} in the microbatch meta") from exc
    c = mean.numel()
    rows = x.shape[0]
    y = x.reshape(rows, c, -1).to(torch.float32)
    scale = (1.0 / 255.0) / std
    y = y * scale[None, :, None] + (-mean / std)[None, :, None]
    if not video and tp > 1:
        y = y[:, :, None, :].expand(rows, c, tp, y.shape[-1])
    return y.reshape(rows, -1)


@dataclass
class Microbatch:
    """One rank's microbatch ``(iteration, microbatch)`` of replica ``replica``."""

    epoch: int
    iteration: int
    microbatch: int
    replica: int
    encoder_keys: list[str]
    llm_keys: list[str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    @property
    def deferred_in(self) -> list[str]:
        """Keys whose LLM part runs here but whose encoder ran in an earlier microbatch."""
        enc = set(self.encoder_keys)
        return [k for k in self.llm_keys if k not in enc]

    @property
    def deferred_out(self) -> list[str]:
        """Keys encoded here whose LLM part runs in a later microbatch."""
        llm = set(self.llm_keys)
        return [k for k in self.encoder_keys if k not in llm]

    @property
    def num_tokens(self) -> int:
        """Packed LLM tokens (0 when the microbatch carries no LLM part)."""
        ids = self.tensors.get("input_ids")
        return 0 if ids is None else int(ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that carry a loss (labels != -100); the per-token loss denominator."""
        labels = self.tensors.get("labels")
        return 0 if labels is None else int((labels != -100).sum())

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Microbatch:
        """A copy with every tensor on ``device``; uint8 pixels become normalised float32 there."""
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}
        for name in PIXEL_TENSORS:
            x = moved.get(name)
            if x is not None and x.dtype == _uint8():
                moved[name] = normalize_pixels(x, self.meta, video=name == "pixel_values_videos")
        return Microbatch(
            self.epoch,
            self.iteration,
            self.microbatch,
            self.replica,
            list(self.encoder_keys),
            list(self.llm_keys),
            moved,
            dict(self.meta),
        )

    @classmethod
    def from_tensors(
        cls, header: Mapping[str, Any], tensors: dict[str, torch.Tensor]
    ) -> Microbatch:
        """Build from a decoded wire header (see :mod:`entrain_data.protocol`) and its tensors."""
        return cls(
            epoch=int(header["epoch"]),
            iteration=int(header["iteration"]),
            microbatch=int(header["microbatch"]),
            replica=int(header["replica"]),
            encoder_keys=list(header.get("encoder_keys", [])),
            llm_keys=list(header.get("llm_keys", [])),
            tensors=tensors,
            meta=dict(header.get("meta", {})),
        )
