"""Text to token ids: a byte-level default, or any Hugging Face-style tokenizer (``.encode``).

Public API (stable):

- ``ByteTokenizer``: ids = UTF-8 bytes + :data:`BYTE_OFFSET`; reserved ids below the offset:
  ``PAD_ID`` 0, ``IMAGE_TOKEN_ID`` 1, ``AUDIO_TOKEN_ID`` 2, ``BOS_ID`` 3, ``EOS_ID`` 4; vocabulary
  261. Deterministic, dependency-free and *exact*: the index builder's token count is the number of
  ids the packer emits (a byte is a token, so counts are ~4x a BPE tokenizer's on English).
- ``as_tokenizer(obj) -> TextTokenizer``: ``None``/``"byte"`` -> ByteTokenizer; a string -> the
  Hugging Face tokenizer of that name or path (``transformers`` needed); an object with ``.encode``
  (a ``transformers`` tokenizer, or anything alike) -> a wrapper that encodes without special
  tokens and takes BOS/EOS and the placeholder ids from the object when it has them.
- ``sample_text_ids(segments, tokenizer) -> (ids, loss_mask)``: the text part of one sample,
  ``[BOS] text... [EOS]``; ``count_text_tokens(segments, tokenizer)`` its length. The index builder
  and the packer both call these, so index and packed sequence agree token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from entrain_data.errors import InvalidInput

from .decode import TextSegment

__all__ = [
    "PAD_ID",
    "IMAGE_TOKEN_ID",
    "AUDIO_TOKEN_ID",
    "BOS_ID",
    "EOS_ID",
    "BYTE_OFFSET",
    "TextTokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "as_tokenizer",
    "sample_text_ids",
    "count_text_tokens",
]

PAD_ID = 0
IMAGE_TOKEN_ID = 1
AUDIO_TOKEN_ID = 2
BOS_ID = 3
EOS_ID = 4
BYTE_OFFSET = 5


class TextTokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    image_token_id: int
    audio_token_id: int
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes shifted by :data:`BYTE_OFFSET`; the ids below it are reserved (see module doc)."""

    bos_id: int | None = BOS_ID
    eos_id: int | None = EOS_ID
    image_token_id: int = IMAGE_TOKEN_ID
    audio_token_id: int = AUDIO_TOKEN_ID
    vocab_size: int = 256 + BYTE_OFFSET

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + BYTE_OFFSET


class HFTokenizer:
    """Wraps a Hugging Face tokenizer (or any object with ``encode(text) -> list[int]``)."""

    def __init__(
        self, tok: Any, image_token_id: int | None = None, audio_token_id: int | None = None
    ) -> None:
        self.tok = tok
        self.bos_id = getattr(tok, "bos_token_id", None)
        self.eos_id = getattr(tok, "eos_token_id", None)
        vocab = getattr(tok, "vocab_size", None)
        if hasattr(tok, "__len__"):  # HF: len() counts added tokens, vocab_size does not
            vocab = max(int(vocab or 0), len(tok))
        self.vocab_size = int(vocab or 0)
        # placeholders: the caller's, else two ids past the vocabulary (the model adds embeddings)
        self.image_token_id = int(image_token_id if image_token_id is not None else self.vocab_size)
        self.audio_token_id = int(
            audio_token_id if audio_token_id is not None else self.vocab_size + 1
        )

    def encode(self, text: str) -> np.ndarray:
        try:
            ids = self.tok.encode(text, add_special_tokens=False)
        except TypeError:
            ids = self.tok.encode(text)
        return np.asarray(ids, dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def as_tokenizer(obj: Any = None) -> TextTokenizer:
    """``None`` or ``"byte"`` -> :class:`ByteTokenizer`; a string -> a Hugging Face tokenizer of
    that name or path (needs ``transformers``); an object with ``encode`` wrapped."""
    if obj is None or (isinstance(obj, str) and obj in ("", "byte", "bytes")):
        return ByteTokenizer()
    if isinstance(obj, str):
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise InvalidInput(
                f"tokenizer {obj!r}: loading a Hugging Face tokenizer by name needs the "
                "'transformers' package (pip install transformers), or pass a tokenizer object"
            ) from exc
        try:
            return HFTokenizer(AutoTokenizer.from_pretrained(obj))
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"tokenizer {obj!r}: cannot load it ({exc})") from exc
    if isinstance(obj, (ByteTokenizer, HFTokenizer)):
        return obj
    if hasattr(obj, "encode"):
        return HFTokenizer(obj)
    raise TypeError(f"tokenizer must have an .encode method, got {type(obj).__name__}")


def sample_text_ids(
    segments: Sequence[TextSegment], tokenizer: TextTokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS] segments... [EOS]`` ids and a bool mask of the ids that carry a loss.

    EOS carries a loss when the last segment does (the model learns to stop).
    """
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    if tokenizer.bos_id is not None:
        ids.append(np.array([tokenizer.bos_id], dtype=np.int64))
        mask.append(np.zeros(1, dtype=bool))
    for seg in segments:
        t = tokenizer.encode(seg.text)
        ids.append(t)
        mask.append(np.full(len(t), seg.loss, dtype=bool))
    if tokenizer.eos_id is not None:
        ids.append(np.array([tokenizer.eos_id], dtype=np.int64))
        mask.append(np.array([bool(segments[-1].loss) if segments else False]))
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate(ids), np.concatenate(mask)


def count_text_tokens(segments: Sequence[TextSegment], tokenizer: TextTokenizer) -> int:
    """Length of :func:`sample_text_ids` (what the index stores as ``text_tokens``)."""
    n = sum(len(tokenizer.encode(s.text)) for s in segments)
    return n + (tokenizer.bos_id is not None) + (tokenizer.eos_id is not None)
