"""A dataset with no index: sizes or costs per sample -> SampleTable / costs -> the static plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from entrain_data.dataset_profile import (
    TableCosts,
    costs_from_fn,
    plan_for_dataset,
    plan_from_costs,
    table_from_sizes,
)
from entrain_data.errors import InvalidInput
from entrain_data.metadata import SampleMeta, VisionItem
from entrain_data.presets import ModelSpec


def test_table_from_sizes_accepts_mappings_and_records():
    def sizes(i):
        if i == 2:
            return SampleMeta("x", "y", 7, images=(VisionItem(8, 360, 640),))
        return {"text_tokens": 10 + i, "images": [(480, 640)] * i, "audio_seconds": [1.5]}

    t = table_from_sizes(3, sizes, name="ds")
    assert list(t.keys) == ["0", "1", "2"] and list(t.rows) == [0, 1, 2]
    assert list(t.text_tokens) == [10, 11, 7] and list(t.image_counts) == [0, 1, 1]
    assert int(t.image_frames[-1]) == 8 and list(t.audio_counts) == [1, 1, 0]


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"tokens": 3}, "text_tokens \\(required\\)"),
        ({"text_tokens": 3, "images": [(1, 2, 3, 4)]}, "2 or 3 sizes"),
        ({"text_tokens": 3, "images": ["big"]}, "\\(height, width\\)"),
        ([3], "expected a mapping"),
        ({"text_tokens": -1}, "text_tokens must be >= 0"),
    ],
)
def test_bad_sizes_name_the_sample(bad, needle):
    with pytest.raises(InvalidInput, match=needle):
        table_from_sizes(2, lambda i: bad)


def test_costs_from_fn_checks_every_value():
    enc, llm, tok = costs_from_fn(4, lambda i: (0.5 * i, 1.0 + i, 3 + i))
    assert enc.shape == (4, 1) and list(llm) == [1, 2, 3, 4] and tok.dtype == np.int64
    with pytest.raises(InvalidInput, match=r"cost_fn\(1\) must return"):
        costs_from_fn(3, lambda i: (1, 2) if i == 1 else (1, 2, 3))
    with pytest.raises(InvalidInput, match=r"cost_fn\(0\).*finite"):
        costs_from_fn(3, lambda i: (float("nan"), 1, 1))


def test_plan_from_costs_cap_fits_the_heaviest_batch():
    tokens = np.array([5000] + [100] * 99)
    plan = plan_from_costs(tokens, dp=2, global_batch=8, microbatches=2)
    assert (plan.dp, plan.pp, plan.microbatches, plan.global_batch) == (2, 1, 2, 8)
    assert plan.max_tokens >= 5000 and plan.max_tokens * 2 * 2 >= 5000 + 7 * 100
    with pytest.raises(InvalidInput, match="does not split over 2"):
        plan_from_costs(tokens, dp=2, global_batch=7)
    with pytest.raises(InvalidInput, match="larger than the dataset"):
        plan_from_costs(tokens, dp=2, global_batch=200)


@pytest.mark.shared_data
def test_plan_for_coco_sizes_prices_like_an_index(shared_data):
    rows = [json.loads(x) for x in (shared_data / "coco_mini" / "captions.jsonl").open()]

    def sizes(i):
        return {
            "text_tokens": len(rows[i]["captions"][0]) + 2,
            "images": [(rows[i]["height"], rows[i]["width"])],
        }

    model = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")
    plan, table = plan_for_dataset(len(rows), dp=2, global_batch=32, sizes_fn=sizes, model=model)
    assert (plan.dp, plan.tp, plan.pp, plan.global_batch) == (2, 1, 1, 32)
    assert len(table) == 160 and plan.model_spec() == model
    enc, llm, tok = TableCosts(table, plan.to_json())()
    assert enc.shape == (160, 1) and np.all(enc > 0) and np.all(llm > 0)
    assert np.all(tok > table.text_tokens)  # image placeholders priced in
    with pytest.raises(InvalidInput, match="exactly one of sizes_fn or cost_fn"):
        plan_for_dataset(4, dp=2, global_batch=2)
    with pytest.raises(InvalidInput, match="needs a model"):
        plan_for_dataset(4, dp=2, global_batch=2, sizes_fn=sizes)


def test_a_cost_fn_whose_tokens_are_all_zero_is_named():
    """It failed as "plan: field 'max_tokens' must be a positive integer, got 0"."""
    with pytest.raises(InvalidInput, match=r"every sample has 0 tokens: cost_fn\(i\)"):
        plan_from_costs(np.zeros(16, dtype=np.int64), dp=2, global_batch=8)


def test_the_plan_is_for_the_gpus_memory_and_refuses_a_model_that_does_not_fit():
    """plan_for_dataset (behind EntrainLoader.wrap) planned for 80 GB GPUs whatever the job
    ran on: a model too large for 16 GB cards passed the plan and ran out of memory later."""
    from entrain_data.dataset_profile import local_gpu_memory_gb
    from entrain_data.errors import PlanError

    model = ModelSpec.from_names(["qwen2.5-vl-vision"], "qwen2.5-7b")
    sizes = lambda i: {"text_tokens": 100 + i, "images": [(448, 448)]}  # noqa: E731
    plan, _ = plan_for_dataset(64, dp=2, global_batch=16, sizes_fn=sizes, model=model)
    assert plan.dp == 2
    with pytest.raises(PlanError, match=r"16 GB"):
        plan_for_dataset(
            64, dp=2, global_batch=16, sizes_fn=sizes, model=model, gpu_memory_gb=16
        )  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        assert local_gpu_memory_gb() == 80.0  # no device: the default
