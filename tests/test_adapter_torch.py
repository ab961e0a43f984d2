"""Plain PyTorch adapter against real torch.distributed (gloo, 2 CPU ranks).

Each test trains the reference MLLM for a few steps on Entrain-balanced,
variable-size microbatches with deferral and checks the parameters equal those
of the same global batches trained in one process without balancing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
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
from entrain_data.adapters.common import EncoderOutputBuffer
from entrain_data.adapters.torch import accumulate_gradients, device_mesh_from_plan

from entrain_data.errors import InvalidInput
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

STEPS = 3

_one_thread = pytest.fixture(autouse=True)(one_thread)
MICROBATCHES = 3


def _plan(dp: int, pp: int) -> ParallelPlan:
    layers = [(0, 2), (2, 4)] if pp == 2 else [(0, 4)]
    stages = tuple(
        StagePlan(i, (StageSegment("llm", None, a, b, i == 0, i == pp - 1),))
        for i, (a, b) in enumerate(layers)
    )
    return ParallelPlan(
        world_size=dp * pp,
        gpus_per_node=8,
        dp=dp,
        tp=1,
        pp=pp,
        stages=stages,
        microbatches=MICROBATCHES,
        global_batch=16,
        max_tokens=4096,
        defer_budget=4096,
    )


def _train_dp(rank: int, world: int, wrapper: str, mode: str, mesh: object) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    if wrapper == "ddp":
        model = DDP(model, process_group=mesh["dp"].get_group())
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    buffer = EncoderOutputBuffer(budget=4096)
    for it, batch in enumerate(global_batches(STEPS)):
        mbs = replica_microbatches(batch, it, world, MICROBATCHES)[rank]
        res = accumulate_gradients(
            model, mbs, mode=mode, dp_group=mesh["dp"].get_group(), buffer=buffer
        )
        assert res.microbatches == MICROBATCHES and res.loss > 0
        opt.step()
        opt.zero_grad()
    assert buffer.peak_tokens > 0, "no sample was deferred: the test would not cover the buffer"
    module = model.module if wrapper == "ddp" else model
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def _dp_rank(rank: int, world: int, runs: list[tuple[str, str]], out: str) -> None:
    """One spawn for several runs: starting ranks (imports) costs more than training here."""
    mesh = device_mesh_from_plan(_plan(dp=world, pp=1))
    states = {f"{w}-{m}": _train_dp(rank, world, w, m, mesh) for w, m in runs}
    if rank == 0:
        torch.save(states, out)


@pytest.mark.timeout(150)
def test_ddp_and_fsdp2_balanced_equal_unbalanced(tmp_path: Path) -> None:
    """DDP (per-token and per-sample loss) and FSDP2 on 2 gloo ranks match one unbalanced process."""
    batches = global_batches(STEPS)
    deferred = [
        count_deferred(rep)
        for it, b in enumerate(batches)
        for rep in replica_microbatches(b, it, 2, MICROBATCHES)
    ]
    per_replica = [deferred[r::2] for r in range(2)]
    both = [all(deferred[2 * it : 2 * it + 2]) for it in range(STEPS)]
    assert all(any(d) for d in per_replica) and any(both), (
        f"scenario must defer on every replica, and on both in one step: {deferred}"
    )
    out = tmp_path / "dp.pt"
    runs = [("ddp", "token"), ("ddp", "sample"), ("fsdp2", "token")]
    run_ranks(_dp_rank, runs, str(out), timeout=130)
    states = torch.load(out)
    for wrapper, mode in runs:
        assert_params_close(states[f"{wrapper}-{mode}"], reference_params(batches, mode))


def test_wrong_normalisation_is_detected(tmp_path: Path) -> None:
    """The equivalence check has teeth: averaging per microbatch (the naive way) differs."""
    batches = global_batches(STEPS)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for it, batch in enumerate(batches):
        mbs = [mb for rep in replica_microbatches(batch, it, 2, MICROBATCHES) for mb in rep]
        buffer = EncoderOutputBuffer()
        for mb in mbs:
            loss_sum, count = model(mb, buffer)
            (loss_sum / count / len(mbs)).backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(AssertionError, match="differ"):
        assert_params_close(model.state_dict(), reference_params(batches))


def test_single_process_accumulation_matches() -> None:
    """Without torch.distributed: all replicas' microbatches on one process, same result."""
    batches = global_batches(STEPS)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for it, batch in enumerate(batches):
        mbs = [mb for rep in replica_microbatches(batch, it, 2, MICROBATCHES) for mb in rep]
        accumulate_gradients(model, mbs)
        opt.step()
        opt.zero_grad()
    assert not dist.is_initialized()
    assert_params_close(model.state_dict(), reference_params(batches))


def test_mesh_needs_matching_world() -> None:
    with pytest.raises(InvalidInput, match="not initialised"):
        device_mesh_from_plan(_plan(dp=2, pp=1))
    with pytest.raises(InvalidInput, match="no microbatches"):
        accumulate_gradients(make_model(), [])
