"""torch.distributed.pipelining (Schedule1F1B) adapter against real torch.distributed (gloo, 2 CPU ranks).

The reference MLLM is cut at the plan's stages (encoders + embedding + LLM
layers 0-1 on stage 0, layers 2-3 + head on stage 1) and trained for a few
steps on Entrain-balanced, variable-size microbatches with deferral, padded per
step to a common length; both stages' parameters must equal those of the same
global batches trained in one process without balancing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import (
    LR,
    assert_params_close,
    count_deferred,
    global_batches,
    make_model,
    one_thread,
    reference_params,
    replica_microbatches,
    run_ranks,
)
from entrain_data.adapters.reference_model import pack_microbatch
from entrain_data.adapters.torch import (
    PipelineTrainer,
    accumulate_gradients,
    device_mesh_from_plan,
    padded_length,
    stage_layers_from_plan,
)

from entrain_data.errors import InvalidInput, PlanError
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

STEPS = 3
MICROBATCHES = 3

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _plan(stage0: tuple[StageSegment, ...] | None = None) -> ParallelPlan:
    """pp=2, dp=1: the vision encoder and LLM layers [0, 2) on stage 0, [2, 4) on stage 1."""
    stage0 = stage0 or (
        StageSegment("vision", 0, 0, 1, True, True),
        StageSegment("llm", None, 0, 2, True, False),
    )
    stages = (StagePlan(0, stage0), StagePlan(1, (StageSegment("llm", None, 2, 4, False, True),)))
    return ParallelPlan(
        world_size=2,
        gpus_per_node=8,
        dp=1,
        tp=1,
        pp=2,
        stages=stages,
        microbatches=MICROBATCHES,
        global_batch=16,
        max_tokens=4096,
        defer_budget=4096,
    )


def _pp_rank(rank: int, world: int, out_dir: str) -> None:
    plan = _plan()
    mesh = device_mesh_from_plan(plan)
    pipe = PipelineTrainer(make_model(), plan, mesh, budget=plan.defer_budget)
    assert pipe.spec.stage == rank
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    results = []
    for it, batch in enumerate(global_batches(STEPS)):
        mbs = replica_microbatches(batch, it, 1, MICROBATCHES)[0]
        results.append(pipe.train_step(mbs))
        opt.step()
        opt.zero_grad()
    torch.save(
        {
            "state": pipe.module.model_state_dict(),
            "results": results,
            "schedules": pipe.schedules_built,
            "deferred_peak": pipe.buffer.peak_tokens,
        },
        Path(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.timeout(150)
def test_1f1b_balanced_equals_unbalanced(tmp_path: Path) -> None:
    """Two 1F1B stages on 2 gloo ranks, padded per step, match one unbalanced process."""
    batches = global_batches(STEPS)
    steps = [replica_microbatches(b, it, 1, MICROBATCHES)[0] for it, b in enumerate(batches)]
    # entrain picks joint sets where they are faster; the fixture then defers one sample
    deferring = [count_deferred(mbs) > 0 for mbs in steps]
    assert all(deferring), f"scenario must defer in every step: {deferring}"
    lengths = {padded_length([mb.num_tokens for mb in mbs]) for mbs in steps}
    assert len(lengths) > 1, "lengths must change between steps to exercise the schedule cache"

    run_ranks(_pp_rank, str(tmp_path), timeout=130)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    want = reference_params(batches)
    stage0, stage1 = ranks[0]["state"], ranks[1]["state"]
    assert not set(stage0) & set(stage1) and any(k.startswith("vision.") for k in stage0)
    for got in (stage0, stage1):
        torch.testing.assert_close(got, {k: want[k] for k in got}, atol=1e-5, rtol=1e-4)
    assert_params_close({**stage0, **stage1}, want, atol=1e-5)  # every parameter, and it trained

    assert ranks[0]["deferred_peak"] > 0, "no deferral crossed the 1F1B schedule"
    assert [r["schedules"] for r in ranks] == [len(lengths)] * 2  # one build per new length
    for r in ranks:
        for res in r["results"]:
            assert res.microbatches == MICROBATCHES
    # every step padded to its longest microbatch and no further
    for step, mbs in enumerate(steps):
        tokens = [mb.num_tokens for mb in mbs]
        want = 1 - sum(tokens) / (len(tokens) * padded_length(tokens))
        for r in ranks:
            assert abs(r["results"][step].padding_fraction - want) < 1e-9
    # the last stage reports the global-batch mean; step 0 runs on the initial parameters
    model, first = make_model(), batches[0]
    keys = [s.key for s in first]
    loss_sum, count = model(pack_microbatch({s.key: s for s in first}, keys, keys))
    got = ranks[1]["results"][0]
    assert got.loss_count == int(count)
    assert got.loss == pytest.approx(float(loss_sum.detach() / count), rel=1e-5)
    assert ranks[0]["results"][0].loss != ranks[0]["results"][0].loss  # NaN off the last stage


def _chain(pipes: list[PipelineTrainer], mbs: list, garbage: bool) -> float:
    """Run both stages by hand on one process, as the schedule would (microbatches in order)."""
    indices, labels = pipes[0].load(mbs)
    pipes[1].load(mbs)
    total = 0.0
    for j in range(len(mbs)):
        hidden, segment = pipes[0].module(indices[j : j + 1])
        if garbage:  # what crosses the stage boundary in padding rows must not matter
            hidden = torch.where((segment >= 0)[..., None], hidden, float("nan"))
        loss = pipes[1].loss_fn(pipes[1].module(hidden, segment), labels[j : j + 1])
        loss.backward()
        total += float(loss.detach())
    pipes[0].buffer.check_drained(mbs[0].iteration)
    return total


@pytest.mark.parametrize("mode", ["token", "sample"])
def test_padding_contributes_nothing(mode: str) -> None:
    """Stages chained on one process with padding far past every microbatch (rows of NaN
    crossing the boundary): loss and gradients equal plain accumulation on the whole model."""
    batch = global_batches(1)[0]
    mbs = replica_microbatches(batch, 0, 1, MICROBATCHES)[0]
    ref = make_model()
    res = accumulate_gradients(ref, mbs, mode=mode)
    model = make_model()
    pipes = [PipelineTrainer(model, _plan(), stage=s, mode=mode, pad_multiple=256) for s in (0, 1)]
    loss = _chain(pipes, mbs, garbage=True)
    assert pipes[0].length == 256 > max(mb.num_tokens for mb in mbs)
    assert loss == pytest.approx(res.loss, rel=1e-5)
    want = {k: p.grad for k, p in ref.named_parameters()}
    for k, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), k
        torch.testing.assert_close(p.grad, want[k], atol=1e-7, rtol=1e-5, msg=k)


def test_plan_refusals() -> None:
    plan = _plan()
    assert (stage_layers_from_plan(plan, 0).start, stage_layers_from_plan(plan, 1).end) == (0, 4)
    gap = _plan((StageSegment("llm", None, 0, 1, True, False),))
    with pytest.raises(PlanError, match="not contiguous"):
        stage_layers_from_plan(gap, 0)
    encoder_only = _plan((StageSegment("vision", 0, 0, 1, True, True),))
    with pytest.raises(PlanError, match="no LLM layers"):
        stage_layers_from_plan(encoder_only, 0)
    with pytest.raises(PlanError, match="stage 5"):
        stage_layers_from_plan(plan, 5)
    with pytest.raises(InvalidInput, match="pad multiple"):
        padded_length([3], 0)
    assert padded_length([5, 17, 3], 8) == 24 and padded_length([], 4) == 4
    with pytest.raises(InvalidInput, match="not initialised"):
        PipelineTrainer(make_model(), plan)
    with pytest.raises(InvalidInput, match="at least one per stage"):
        PipelineTrainer(make_model(), plan, stage=0).train_step([])
