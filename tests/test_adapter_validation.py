"""Bad input at the adapters' entry points: refused with an error naming the iteration,
microbatch and field, instead of a count of 0, a shape error deep in a kernel, or a hang."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from _dist import global_batches, make_model, one_thread, replica_microbatches
from entrain_data.adapters.common import (
    EncoderOutputBuffer,
    check_microbatch,
    collective_device,
    iteration_microbatches,
    loss_units,
)
from entrain_data.adapters.torch import accumulate_gradients

from entrain_data.batch import Microbatch
from entrain_data.errors import InvalidInput
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _mbs() -> list[Microbatch]:
    return replica_microbatches(global_batches(1)[0], 0, 1, 3)[0]


def _with(mb: Microbatch, **fields: torch.Tensor | None) -> Microbatch:
    """``mb`` with tensors replaced (or dropped, for None)."""
    tensors = dict(mb.tensors)
    for name, value in fields.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return Microbatch(
        mb.epoch, mb.iteration, mb.microbatch, mb.replica, mb.encoder_keys, mb.llm_keys,
        tensors, mb.meta,
    )  # fmt: skip


def _bad_cases(mb: Microbatch) -> dict[str, tuple[Microbatch, str]]:
    n = mb.num_tokens
    return {
        "no labels": (_with(mb, labels=None), "field 'labels' is missing"),
        "no input_ids": (_with(mb, input_ids=None), "field 'input_ids' is missing"),
        "short labels": (_with(mb, labels=mb["labels"][:-5]), "'labels' has"),
        "2-D labels": (_with(mb, labels=mb["labels"][None]), "not 1-D"),
        "float labels": (_with(mb, labels=mb["labels"].float()), "not an integer"),
        "cu total": (
            _with(mb, cu_seqlens=torch.tensor([0, 5, n - 1], dtype=torch.int32)),
            "'cu_seqlens'",
        ),
        "cu count": (_with(mb, cu_seqlens=torch.tensor([0, n], dtype=torch.int32)), "entries"),
    }


@pytest.mark.parametrize("case", list(_bad_cases(_mbs()[1])))
def test_entry_points_name_microbatch_and_field(case: str) -> None:
    mbs = _mbs()
    bad, match = _bad_cases(mbs[1])[case]
    assert len(mbs[1].llm_keys) > 1
    where = "iteration 0 microbatch 1"
    with pytest.raises(InvalidInput, match=f"{where}.*{match}"):
        check_microbatch(bad, "test")
    with pytest.raises(InvalidInput, match=f"accumulate_gradients: {where}.*{match}"):
        accumulate_gradients(make_model(), [mbs[0], bad, mbs[2]])


def test_loss_units_refuses_missing_fields() -> None:
    mb = _mbs()[0]
    with pytest.raises(InvalidInput, match="microbatch 0.*'labels' is missing"):
        loss_units(_with(mb, labels=None))
    with pytest.raises(InvalidInput, match="'cu_seqlens' is missing"):
        loss_units(_with(mb, cu_seqlens=None), "sample")
    empty = Microbatch(0, 0, 2, 0, [], [], {})  # no LLM part at all: legitimately no loss
    check_microbatch(empty, "test")
    assert loss_units(empty) == 0 and loss_units(empty, "sample") == 0


def test_microbatch_lists_are_checked_and_materialised() -> None:
    mbs = _mbs()
    assert iteration_microbatches(iter(mbs), "test") == mbs
    with pytest.raises(InvalidInput, match="no microbatches"):
        iteration_microbatches([], "test")
    with pytest.raises(InvalidInput, match="got a dict, not a Microbatch"):
        iteration_microbatches([dict(mbs[0].tensors)], "test")
    with pytest.raises(InvalidInput, match="expected this iteration's microbatches"):
        iteration_microbatches(mbs[0], "test")
    later = replica_microbatches(global_batches(2)[1], 1, 1, 3)[0]
    with pytest.raises(InvalidInput, match="one iteration at a time"):
        iteration_microbatches([mbs[0], later[1]], "test")
    with pytest.raises(InvalidInput, match="budget must be an int"):
        EncoderOutputBuffer("10")  # type: ignore[arg-type]


def test_accumulate_gradients_takes_a_generator() -> None:
    """A generator used to be consumed by the buffer's announcements, leaving nothing to
    count ("no loss tokens"; with dp > 1 a hang): it is read once, into a list."""
    mbs = _mbs()
    grads = []
    for given in (list(mbs), (mb for mb in mbs)):
        model = make_model()
        res = accumulate_gradients(model, given)
        assert res.microbatches == 3 and res.loss_count == sum(m.num_loss_tokens for m in mbs)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)


def test_collective_device() -> None:
    assert collective_device(None, "cpu") == torch.device("cpu")
    assert collective_device(None, None) == torch.device("cpu")  # no process group


# ------------------------------------------------------------------ DeepSpeed config
def _plan(global_batch: int = 16) -> ParallelPlan:
    stage = StagePlan(0, (StageSegment("llm", None, 0, 4, True, True),))
    return ParallelPlan(
        world_size=2, gpus_per_node=8, dp=2, tp=1, pp=1, stages=(stage,),
        microbatches=3, global_batch=global_batch, max_tokens=4096, defer_budget=4096,
    )  # fmt: skip


def test_deepspeed_config_takes_what_deepspeed_takes(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from entrain_data.adapters.deepspeed import deepspeed_config

    user = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}
    want = deepspeed_config(_plan(), user)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(user))
    assert deepspeed_config(_plan(), str(path)) == want
    assert deepspeed_config(_plan(), path) == want
    assert deepspeed_config(_plan(), json.dumps(user)) == want
    assert (
        deepspeed_config(_plan(), base64.urlsafe_b64encode(json.dumps(user).encode()).decode())
        == want
    )
    with pytest.raises(InvalidInput, match="'missing.json': neither an existing file"):
        deepspeed_config(_plan(), "missing.json")
    path.write_text("[1, 2]")
    with pytest.raises(InvalidInput, match="holds a list"):
        deepspeed_config(_plan(), path)
    with pytest.raises(InvalidInput, match="got int"):
        deepspeed_config(_plan(), 3)  # type: ignore[arg-type]


def test_deepspeed_config_accepts_the_plans_global_batch() -> None:
    """global_batch 16 over dp 2 x 3 microbatches: the nominal micro batch is 2, DeepSpeed's
    train_batch_size must be 2 * 3 * 2 = 12; the user's 16 (the plan's own) is not a conflict."""
    pytest.importorskip("deepspeed")
    from entrain_data.adapters.deepspeed import deepspeed_config

    cfg = deepspeed_config(_plan(16), {"train_batch_size": 16})
    assert cfg["train_batch_size"] == 12 and cfg["train_micro_batch_size_per_gpu"] == 2
    # DeepSpeed asserts train_batch_size == micro * accumulation * dp (runtime/config.py)
    assert cfg["train_batch_size"] == 2 * cfg["gradient_accumulation_steps"] * 2
    with pytest.raises(InvalidInput, match="train_batch_size=15 conflicts"):
        deepspeed_config(_plan(16), {"train_batch_size": 15})
