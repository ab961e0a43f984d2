"""Module configurations (encoders, LLM) and the presets built from published model configs.

A :class:`ModuleConfig` holds exactly the numbers the cost model needs: the
transformer shape (hidden, layers, FFN, heads, KV heads) and how raw sizes
become tokens (patching, resize policy, merging; audio framing). Presets are
JSON files in ``entrain_data/presets/``, one per published model, each citing
the config it was taken from; a user may pass the path of a JSON file with the
same fields instead of a preset name.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import InvalidInput

__all__ = ["ModuleConfig", "ModelSpec", "list_presets", "load_module", "KINDS", "RESIZE_POLICIES"]

KINDS = ("vision", "audio", "llm")
RESIZE_POLICIES = ("fixed", "dynamic", "tiles")
PROJECTORS = ("none", "linear", "mlp2x", "merger")
_SHAPE_FIELDS = ("hidden", "layers", "ffn", "heads", "kv_heads")


@dataclass(frozen=True)
class ModuleConfig:
    """One encoder or the LLM, with the shape numbers of its published config.

    Vision: ``resize`` is ``fixed`` (every image/frame resized to
    ``image_size``), ``dynamic`` (Qwen2-VL ``smart_resize`` into
    ``[min_pixels, max_pixels]``, multiples of ``patch_size * merge``) or
    ``tiles`` (InternVL dynamic tiling into ``image_size`` tiles, up to
    ``max_tiles`` plus a thumbnail). ``merge`` is the spatial merge factor per
    side (2: 2x2 patches become one LLM token; InternVL's pixel shuffle 0.5 is
    the same). ``window_patches`` > 0: window attention over square windows of
    that many patches per side, except in ``full_attention_layers``.
    Audio: log-mel frames at ``audio_frame_rate`` per second, a conv stem with
    ``audio_conv_stride``, fixed ``audio_window_seconds`` windows (inputs padded
    to the window), then ``audio_pool`` pooling before the LLM.
    """

    name: str
    kind: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int = 0  # 0: hidden // heads
    gated_mlp: bool = False  # SwiGLU (3 matrices) vs GELU MLP (2)
    vocab: int = 0  # LLM only
    tie_embeddings: bool = False  # LM head shares the embedding's weights (Llama 3.2 1B/3B)
    # vision
    patch_size: int = 0
    temporal_patch: int = 1
    merge: int = 1
    resize: str = "fixed"
    image_size: int = 0
    min_pixels: int = 0
    max_pixels: int = 0
    video_min_pixels: int = 0  # per frame; 0: same as min_pixels
    video_max_pixels: int = 0  # per frame; 0: same as max_pixels
    video_total_pixels: int = (
        0  # pixel budget of a whole clip (per-frame cap shrinks with frames); 0: none
    )
    max_tiles: int = 1
    thumbnail: bool = False
    cls_token: bool = False
    window_patches: int = 0
    full_attention_layers: tuple[int, ...] = ()
    in_channels: int = 3
    # pixel normalisation of the published processor, (x / 255 - mean) / std per channel; it runs on
    # the training device (pixels travel as uint8), so the values travel with every microbatch
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP / Qwen2-VL
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    # audio
    n_mels: int = 0
    audio_frame_rate: float = 100.0
    audio_conv_stride: int = 2
    audio_window_seconds: float = 30.0
    audio_pool: int = 1
    # encoder -> LLM projector
    projector: str = "none"
    frozen: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        self._check_types()
        if self.kind not in KINDS:
            raise InvalidInput(
                f"module {self.name!r}: field 'kind' must be one of {KINDS}, got {self.kind!r}"
            )
        if self.heads % self.kv_heads:
            raise InvalidInput(
                f"module {self.name!r}: 'heads' ({self.heads}) is not a multiple of 'kv_heads' ({self.kv_heads})"
            )
        if self.head_dim < 0 or (self.head_dim == 0 and self.hidden % self.heads):
            raise InvalidInput(
                f"module {self.name!r}: field 'head_dim' must be given when hidden % heads != 0"
            )
        if self.kind == "llm" and self.vocab < 1:
            raise InvalidInput(f"module {self.name!r}: field 'vocab' must be >= 1 for an LLM")
        if self.kind == "vision":
            if self.patch_size < 1 or self.merge < 1 or self.temporal_patch < 1:
                raise InvalidInput(
                    f"module {self.name!r}: fields 'patch_size', 'merge', 'temporal_patch' must be >= 1"
                )
            if self.resize not in RESIZE_POLICIES:
                raise InvalidInput(
                    f"module {self.name!r}: field 'resize' must be one of {RESIZE_POLICIES}, got {self.resize!r}"
                )
            if self.resize in ("fixed", "tiles") and (
                self.image_size < self.patch_size
                or (self.image_size // self.patch_size) % self.merge
            ):
                raise InvalidInput(
                    f"module {self.name!r}: field 'image_size' // patch_size must be >= 1 and a multiple of merge"
                )
            if self.resize == "dynamic" and not (0 < self.min_pixels <= self.max_pixels):
                raise InvalidInput(
                    f"module {self.name!r}: fields 'min_pixels'/'max_pixels' must satisfy 0 < min <= max"
                )
            if self.max_tiles < 1:
                raise InvalidInput(f"module {self.name!r}: field 'max_tiles' must be >= 1")
            for f in ("image_mean", "image_std"):
                v = getattr(self, f)
                if len(v) != self.in_channels or (f == "image_std" and min(v) <= 0):
                    raise InvalidInput(
                        f"module {self.name!r}: field {f!r} needs {self.in_channels} values"
                        + (" > 0" if f == "image_std" else "")
                    )
        if self.kind == "audio" and (
            self.n_mels < 1 or self.audio_frame_rate <= 0 or self.audio_window_seconds <= 0
        ):
            raise InvalidInput(
                f"module {self.name!r}: audio fields 'n_mels', 'audio_frame_rate', 'audio_window_seconds' must be > 0"
            )
        for f in ("audio_conv_stride", "audio_pool"):  # divisors of the frame count
            v = getattr(self, f)
            whole = (
                not isinstance(v, bool) and isinstance(v, numbers.Real) and float(v).is_integer()
            )
            if self.kind == "audio" and (not whole or v < 1):
                raise InvalidInput(f"module {self.name!r}: field {f!r} must be a whole number >= 1")
        if self.projector not in PROJECTORS:
            raise InvalidInput(
                f"module {self.name!r}: field 'projector' must be one of {PROJECTORS}"
            )
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.layers]
        if bad:
            raise InvalidInput(
                f"module {self.name!r}: 'full_attention_layers' {bad} outside 0..{self.layers - 1}"
            )

    def _check_types(self) -> None:
        """Every field has its declared type (JSON ``true`` is no integer, ``"3136"`` no
        number) and every count is >= 0, so a bad config names its field here instead of
        failing in a comparison or, worse, planning with a negative window."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("audio_conv_stride", "audio_pool"):
                continue  # whole numbers, checked below for audio modules
            if f.type == "int":
                low = 1 if f.name in _SHAPE_FIELDS else 0
                ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= low
                want = "a positive integer" if low else "an integer >= 0"
            elif f.type == "float":
                ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                want = "a finite number"
            elif f.type == "bool":
                ok, want = isinstance(v, bool), "true or false"
            elif f.type == "str":
                ok, want = isinstance(v, str), "a string"
            elif f.type.startswith("tuple["):
                item_int = "int" in f.type
                ok = isinstance(v, tuple) and all(
                    not isinstance(x, bool)
                    and isinstance(x, numbers.Integral if item_int else numbers.Real)
                    for x in v
                )
                want = "a list of integers" if item_int else "a list of numbers"
            else:  # pragma: no cover - every field's type is one of the above
                continue
            if not ok:
                raise InvalidInput(
                    f"module {self.name!r}: field {f.name!r} must be {want}, got {v!r}"
                )

    # ------------------------------------------------------------------ shape
    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def is_encoder(self) -> bool:
        return self.kind != "llm"

    def window_layer_mask(self) -> list[bool]:
        """True for layers that attend within windows (only with ``window_patches``)."""
        full = set(self.full_attention_layers)
        return [self.window_patches > 0 and i not in full for i in range(self.layers)]

    def layer_parameters(self) -> int:
        """Weights of one transformer layer (attention + MLP; norms and biases ignored)."""
        q = self.heads * self.dim_head
        kv = 2 * self.kv_heads * self.dim_head
        attn = self.hidden * (q + kv) + q * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attn + mlp

    def embed_parameters(self) -> int:
        """Weights before the first layer: token embedding, patch embedding or audio conv stem."""
        if self.kind == "llm":
            return self.vocab * self.hidden
        if self.kind == "vision":
            return self.in_channels * self.temporal_patch * self.patch_size**2 * self.hidden
        return 3 * self.n_mels * self.hidden + 3 * self.hidden * self.hidden

    def head_parameters(self, llm_hidden: int = 0) -> int:
        """Weights after the last layer: LM head, or the projector into an LLM of ``llm_hidden``."""
        if self.kind == "llm":
            return 0 if self.tie_embeddings else self.vocab * self.hidden
        d_in = self.hidden * self.merge**2 if self.kind == "vision" else self.hidden
        if self.projector == "mlp2x":  # LLaVA / InternVL: d_in -> llm -> llm
            return d_in * llm_hidden + llm_hidden * llm_hidden
        if self.projector == "merger":  # Qwen2-VL PatchMerger: d_in -> d_in -> llm
            return d_in * d_in + d_in * llm_hidden
        if self.projector == "linear":
            return d_in * llm_hidden
        return 0

    def parameters(self, llm_hidden: int = 0) -> int:
        """All weights (used by the planner's memory estimate)."""
        return (
            self.layers * self.layer_parameters()
            + self.embed_parameters()
            + self.head_parameters(llm_hidden)
        )

    # ------------------------------------------------------------ (de)serial
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (plans embed the model they were made for)."""
        d = asdict(self)
        d["full_attention_layers"] = list(self.full_attention_layers)
        d["image_mean"] = list(self.image_mean)
        d["image_std"] = list(self.image_std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], origin: str = "<dict>") -> ModuleConfig:
        if not isinstance(d, dict):
            raise InvalidInput(f"{origin}: a module config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidInput(f"{origin}: unknown field(s) {', '.join(map(repr, unknown))}")
        missing = [
            f
            for f in ("name", "kind", "hidden", "layers", "ffn", "heads", "kv_heads")
            if f not in d
        ]
        if missing:
            raise InvalidInput(f"{origin}: missing field(s) {', '.join(map(repr, missing))}")
        d = dict(d)
        for f in ("full_attention_layers", "image_mean", "image_std"):
            if f in d:  # JSON lists become tuples; the items are checked in __post_init__
                if not isinstance(d[f], (list, tuple)):
                    raise InvalidInput(f"{origin}: field {f!r} must be a list, got {d[f]!r}")
                d[f] = tuple(d[f])
        try:
            return cls(**d)
        except InvalidInput as exc:
            raise InvalidInput(f"{origin}: {exc}") from exc
        except TypeError as exc:  # pragma: no cover - guarded by the field checks above
            raise InvalidInput(f"{origin}: {exc}") from exc

    def with_frozen(self, frozen: bool = True) -> ModuleConfig:
        """This module frozen (forward only in training) or trainable again."""
        return replace(self, frozen=frozen)


@dataclass(frozen=True)
class ModelSpec:
    """The modules of one MLLM: column ``e`` of every ``[N, E]`` cost array is ``encoders[e]``."""

    encoders: tuple[ModuleConfig, ...]
    llm: ModuleConfig
    name: str = field(default="")

    def __post_init__(self) -> None:
        if self.llm.kind != "llm":
            raise InvalidInput(
                f"model spec: 'llm' must be a module of kind 'llm', got {self.llm.name!r} ({self.llm.kind})"
            )
        for e in self.encoders:
            if e.kind == "llm":
                raise InvalidInput(f"model spec: encoder {e.name!r} has kind 'llm'")
        names = [e.name for e in self.encoders] + ["llm"]
        if len(set(names)) != len(names):
            raise InvalidInput(f"model spec: module names must be unique, got {names}")
        object.__setattr__(self, "encoders", tuple(self.encoders))

    @property
    def module_names(self) -> tuple[str, ...]:
        """Encoder names then ``"llm"`` (the names stages and profiles use)."""
        return tuple(e.name for e in self.encoders) + ("llm",)

    def module(self, name: str) -> ModuleConfig:
        """The module called ``name`` (``"llm"`` or a module's own name); InvalidInput otherwise."""
        if name == "llm" or name == self.llm.name:
            return self.llm
        for e in self.encoders:
            if e.name == name:
                return e
        raise InvalidInput(f"model spec: no module named {name!r} (have {list(self.module_names)})")

    def encoder_parameters(self, e: int) -> int:
        """Parameter count of encoder ``e`` including its projector to the LLM width."""
        return self.encoders[e].parameters(self.llm.hidden)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; ``ModelSpec.from_dict`` reads it back."""
        return {
            "name": self.name,
            "encoders": [e.to_dict() for e in self.encoders],
            "llm": self.llm.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        if not isinstance(d, dict) or "llm" not in d:
            raise InvalidInput("model spec: expected an object with 'encoders' and 'llm'")
        return cls(
            encoders=tuple(
                ModuleConfig.from_dict(e, "model spec encoder") for e in d.get("encoders", [])
            ),
            llm=ModuleConfig.from_dict(d["llm"], "model spec llm"),
            name=str(d.get("name", "")),
        )

    @classmethod
    def from_names(
        cls, encoders: list[str] | tuple[str, ...], llm: str, frozen_encoders: bool = False
    ) -> ModelSpec:
        """Build from preset names or JSON paths (what the CLI's ``--encoder``/``--llm`` take)."""
        encs = tuple(
            load_module(e).with_frozen(frozen_encoders) if frozen_encoders else load_module(e)
            for e in encoders
        )
        lm = load_module(llm)
        return cls(encoders=encs, llm=lm, name="+".join([e.name for e in encs] + [lm.name]))


def _preset_dir():
    return resources.files("entrain_data") / "presets"


def list_presets() -> list[str]:
    """Names of the bundled presets, sorted."""
    return sorted(
        p.name[: -len(".json")] for p in _preset_dir().iterdir() if p.name.endswith(".json")
    )


def load_module(name_or_path: str | Path) -> ModuleConfig:
    """A preset by name, or a JSON config file with :class:`ModuleConfig` fields."""
    s = str(name_or_path)
    if s in list_presets():
        text = (_preset_dir() / f"{s}.json").read_text()
        origin = f"preset {s!r}"
    else:
        p = Path(s)
        if not (s.endswith(".json") or p.exists()):
            raise InvalidInput(
                f"unknown model preset {s!r} (known: {', '.join(list_presets())}; or give a JSON config path)"
            )
        if not p.is_file():
            raise InvalidInput(f"model config file not found: {s}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"model config {s}: not a UTF-8 JSON file ({exc.reason})") from exc
        origin = str(p)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{origin}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    return ModuleConfig.from_dict(d, origin)
