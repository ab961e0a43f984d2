"""Synthetic workloads: determinism, valid tables, distributions that match their sources."""

from __future__ import annotations

import numpy as np
import pytest

from entrain_data import workload_tables as T
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import InvalidInput
from entrain_data.metadata import read_index, write_index
from entrain_data.presets import ModelSpec
from entrain_data.workloads import CHARS_PER_TOKEN, list_workloads, synthesize

NAMES = ["llava-fixed", "qwen2vl-dynamic", "multi-image-video", "vision-audio", "text-heavy"]


def test_named_workloads_exist():
    assert set(NAMES) <= set(list_workloads())


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_valid_and_round_trips(name, tmp_path):
    a = synthesize(name, 3000, seed=7)
    b = synthesize(name, 3000, seed=7)
    c = synthesize(name, 3000, seed=8)
    assert len(a) == 3000 and len(set(a.keys.tolist())) == 3000
    for col in (
        "text_tokens",
        "image_offsets",
        "image_height",
        "image_width",
        "image_frames",
        "audio_seconds",
    ):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    assert not np.array_equal(a.text_tokens, c.text_tokens)
    a.validate()
    assert np.all(a.text_tokens > 0)
    back = read_index(write_index(a, tmp_path / "i.parquet"))
    assert np.array_equal(back.text_tokens, a.text_tokens) and np.array_equal(
        back.image_width, a.image_width
    )
    # a prefix of a larger draw need not match, but every sample is costable under a fitting model
    enc = ["qwen2.5-vl-vision"] + (["whisper-large-v3-encoder"] if len(a.audio_seconds) else [])
    costs = per_sample_costs(a, ModelSpec.from_names(enc, "llama-3.2-1b"))
    assert np.all(costs.llm_cost() > 0)


def test_llava_fixed_matches_llava_instruct_and_coco():
    t = synthesize("llava-fixed", 20000, seed=0)
    assert np.all(t.image_counts == 1) and len(t.audio_seconds) == 0
    # every COCO image has its long side <= 640 px
    assert max(t.image_height.max(), t.image_width.max()) <= 640
    long = np.maximum(t.image_height, t.image_width)
    assert np.mean(long == 640) == pytest.approx(0.8, abs=0.1)  # COCO: ~80% at 640
    portrait = np.mean(t.image_height > t.image_width)
    assert portrait == pytest.approx(T.COCO_PORTRAIT_FRACTION, abs=0.02)
    # text: the mixture median of LLaVA-Instruct (chars / 4 + template) lies between its kinds' medians
    med = np.median(t.text_tokens)
    kinds = sorted(
        tab[8] / CHARS_PER_TOKEN
        for tab in (T.LLAVA_CONV_CHARS, T.LLAVA_DETAIL_CHARS, T.LLAVA_COMPLEX_CHARS)
    )
    assert kinds[0] < med < kinds[-1] + 60


def test_qwen2vl_dynamic_has_high_resolution_documents():
    t = synthesize("qwen2vl-dynamic", 20000, seed=0)
    pixels = t.image_height.astype(np.int64) * t.image_width
    # SROIE: 13% of documents are 600 dpi pages (~35 MP); documents are 20% of samples
    frac_pages = np.mean(pixels > 20e6)
    assert 0.2 * T.SROIE_PAGE_FRACTION * 0.6 < frac_pages < 0.2 * T.SROIE_PAGE_FRACTION * 1.4
    assert np.any(t.image_counts > 1)  # multi-image part


def test_video_and_audio_durations_follow_sources():
    v = synthesize("multi-image-video", 20000, seed=0)
    clips = v.image_frames[v.image_frames > 1]
    assert len(clips) > 0 and clips.max() <= 64 and np.all(clips % 2 == 0)
    # clips take NExT-QA's frame sizes: 640x480 is the most common (41% of its videos)
    is_clip = v.image_frames > 1
    share_480p = np.mean((v.image_width[is_clip] == 640) & (v.image_height[is_clip] == 480))
    assert share_480p == pytest.approx(641 / 1424, abs=0.05)
    a = synthesize("vision-audio", 20000, seed=0)
    secs = a.audio_seconds
    assert secs.min() >= T.COMMON_VOICE_ID_SECONDS[0] - 1e-3
    assert secs.max() <= max(T.LIBRISPEECH_SECONDS[-1], T.COMMON_VOICE_ID_SECONDS[-1]) + 1e-3
    # mixture median lies between the Common Voice and LibriSpeech medians
    assert T.COMMON_VOICE_ID_SECONDS[8] <= np.median(secs) <= T.LIBRISPEECH_SECONDS[8]


def test_text_heavy_is_mostly_text_only_and_long():
    t = synthesize("text-heavy", 20000, seed=0)
    assert np.mean(t.image_counts == 0) == pytest.approx(0.70, abs=0.02)
    text_only = t.text_tokens[t.image_counts == 0]
    assert np.median(text_only) > 1000 and np.quantile(text_only, 0.99) > 5000


def test_bad_arguments():
    with pytest.raises(InvalidInput, match="unknown workload 'nope'"):
        synthesize("nope", 10)
    with pytest.raises(InvalidInput, match="samples"):
        synthesize("llava-fixed", -1)
    assert len(synthesize("llava-fixed", 0)) == 0


@pytest.mark.shared_data
def test_real_workloads_build_from_shared_metadata(shared_data):
    from entrain_data.real_workloads import list_real_workloads, real_workload

    names = list_real_workloads()
    assert {
        "coco-captions",
        "llava-instruct",
        "sroie-docs",
        "librispeech",
        "video-activitynet",
    } <= set(names)
    sizes = {}
    for name in names:
        t = real_workload(name, shared_data)
        t.validate()
        assert len(t) > 0 and np.all(t.text_tokens > 0)
        sizes[name] = len(t)
    assert (
        sizes["coco-captions"] == 5000
        and sizes["sroie-docs"] == 626
        and sizes["librispeech"] == 2703
    )
    assert sizes["llava-instruct"] == 157500
    docs = real_workload("sroie-docs", shared_data / "metadata")
    assert int(docs.image_width.max()) == 4961 and int(docs.image_height.max()) == 7016
    ls = real_workload("librispeech", shared_data)
    assert float(ls.audio_seconds.max()) == pytest.approx(32.645, abs=1e-3)
    with pytest.raises(InvalidInput, match="unknown real workload"):
        real_workload("imagenet", shared_data)


def test_real_workload_missing_dir(tmp_path):
    from entrain_data.real_workloads import real_workload

    with pytest.raises(InvalidInput, match="not found"):
        real_workload("librispeech", tmp_path / "nowhere")


@pytest.mark.shared_data
def test_synthetic_llava_matches_the_real_table(shared_data):
    """The quantile-table generator reproduces the real LLaVA-Instruct text lengths (mean, spread)."""
    from entrain_data.real_workloads import real_workload

    real = real_workload("llava-instruct", shared_data).text_tokens.astype(float)
    synth = synthesize("llava-fixed", 50000, seed=0).text_tokens.astype(float)
    assert synth.mean() == pytest.approx(real.mean(), rel=0.03)
    assert synth.std() == pytest.approx(real.std(), rel=0.08)
    for q in (0.1, 0.5, 0.9):
        assert np.quantile(synth, q) == pytest.approx(np.quantile(real, q), rel=0.08)
