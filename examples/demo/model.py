"""The demo's tiny MLLM: its cost-model view and the reference model built to the same sizes."""

from __future__ import annotations

from entrain_data.presets import ModelSpec, ModuleConfig

__all__ = ["RANKS", "METHODS", "demo_model_spec", "demo_reference_config"]

METHODS = ("sequential", "entrain")
RANKS = 2


def demo_model_spec() -> ModelSpec:
    """Cost-model view of the demo's tiny MLLM; token geometry matches the reference model
    (one encoder token per 16 px patch and per audio frame at 10 frames/s)."""
    vision = ModuleConfig(
        name="demo-vision",
        kind="vision",
        hidden=96,
        layers=2,
        ffn=192,
        heads=2,
        kv_heads=2,
        patch_size=16,
        temporal_patch=1,
        merge=1,
        resize="dynamic",
        min_pixels=32 * 32,
        max_pixels=192 * 192,
        source="entrain_data demo",
    )
    audio = ModuleConfig(
        name="demo-audio",
        kind="audio",
        hidden=32,
        layers=2,
        ffn=64,
        heads=2,
        kv_heads=2,
        n_mels=16,
        audio_frame_rate=10.0,
        audio_conv_stride=1,
        audio_window_seconds=30.0,
        audio_pool=1,
        source="entrain_data demo",
    )
    llm = ModuleConfig(
        name="demo-llm",
        kind="llm",
        hidden=64,
        layers=2,
        ffn=128,
        heads=4,
        kv_heads=4,
        vocab=261,
        source="entrain_data demo",
    )
    return ModelSpec(encoders=(vision, audio), llm=llm, name="demo")


def demo_reference_config():
    """The reference model with the demo spec's sizes."""
    from entrain_data.adapters.reference_model import ReferenceConfig

    spec = demo_model_spec()
    v, a = spec.encoders
    return ReferenceConfig(
        vocab=spec.llm.vocab,
        hidden=spec.llm.hidden,
        heads=2,
        llm_layers=spec.llm.layers,
        patch_dim=3 * v.temporal_patch * v.patch_size**2,
        vision_hidden=v.hidden,
        n_mels=a.n_mels,
        audio_hidden=a.hidden,
    )
