"""Helpers for the multi-rank adapter tests: free ports, bounded spawn, the shared scenario.

Every rank runs in a fresh ``spawn`` process with its own gloo process group on a
free port; the process group is always destroyed, the parent kills every rank
on timeout, and a rank's traceback comes back in the assertion message.

The scenario: a few global batches of synthetic multimodal samples of widely
varying sizes, split by Entrain's ``assign()`` into dp x M variable-size
microbatches with deferral, against the reference run that trains the same
global batches in one process as one unbalanced batch.
"""

from __future__ import annotations

import functools
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from entrain_data.adapters.reference_model import (
    ReferenceMLLM,
    SyntheticSample,
    pack_microbatch,
    synthetic_samples,
)

from entrain_data.assignment import Assignment, assign, check_assignment
from entrain_data.batch import Microbatch

__all__ = [
    "free_port",
    "run_ranks",
    "global_batches",
    "replica_microbatches",
    "count_deferred",
    "make_model",
    "reference_params",
    "reference_params_bf16",
    "reference_params_adam",
    "make_adam",
    "bf16_noise",
    "assert_params_close",
]

SAMPLES_PER_BATCH = 16
LR = 0.1


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, world: int, port: int, fn: Callable, args: tuple, err_dir: str, env: dict
) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        fn(rank, world, *args)
        dist.barrier()  # rank 0 hosts the store: nobody leaves before everyone is done
    except BaseException:
        Path(err_dir, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable, *args: Any, world: int = 2, timeout: float = 120.0, env: dict | None = None
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; raise on error or timeout."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as err_dir:
        procs = [
            ctx.Process(
                target=_rank_main, args=(r, world, port, fn, args, err_dir, env or {}), daemon=True
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.is_alive() for p in procs):
                if any(Path(err_dir).glob("rank*.txt")):
                    break  # one rank failed: the others may wait on it forever
                time.sleep(0.05)
            for p in procs:
                p.join(0.5 if p.exitcode is None else 0)
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            errors = {f.name: f.read_text() for f in sorted(Path(err_dir).glob("rank*.txt"))}
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if errors:
            raise AssertionError(
                "rank failed:\n" + "\n".join(f"{k}:\n{v}" for k, v in errors.items())
            )
        if alive:
            raise AssertionError(f"ranks {alive} still running after {timeout} s: killed")
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"rank exit codes {codes}"


# ------------------------------------------------------------------ scenario
def global_batches(steps: int, seed: int = 1) -> list[list[SyntheticSample]]:
    """``steps`` global batches of synthetic samples (keys unique across batches)."""
    return [
        synthetic_samples(SAMPLES_PER_BATCH, seed=seed + i, prefix=f"b{i}-") for i in range(steps)
    ]


def entrain_assignment(
    batch: list[SyntheticSample], iteration: int, dp: int, microbatches: int
) -> Assignment:
    """Entrain's assignment of ``batch``. Where a replica defers nothing (entrain picks
    joint sets where they are faster), its smallest encoded sample in a microbatch shared
    with another is consumed one microbatch later: the adapters' deferral path runs on
    every rank whatever the assignment chose."""
    enc = np.array([s.encoder_tokens**1.5 for s in batch], dtype=float)
    llm = np.array([s.llm_tokens for s in batch], dtype=float)
    tokens = np.array([s.llm_tokens for s in batch], dtype=np.int64)
    budget = 10_000
    a = assign(
        enc,
        llm,
        tokens,
        dp=dp,
        microbatches=microbatches,
        defer_budget=budget,
        seed=0,
        iteration=iteration,
    )
    a = _defer_one_per_replica(a, enc, tokens)
    check_assignment(a, len(batch), tokens, None, budget)
    return a


def replica_microbatches(
    batch: list[SyntheticSample], iteration: int, dp: int, microbatches: int
) -> list[list[Microbatch]]:
    """:func:`entrain_assignment` of ``batch``: per replica, its microbatches in order."""
    a = entrain_assignment(batch, iteration, dp, microbatches)
    keys = [s.key for s in batch]
    samples = {s.key: s for s in batch}
    return [
        [
            pack_microbatch(
                samples,
                [keys[i] for i in a.encoder_sets[r][j]],
                [keys[i] for i in a.llm_sets[r][j]],
                iteration=iteration,
                microbatch=j,
                replica=r,
            )
            for j in range(microbatches)
        ]
        for r in range(dp)
    ]


def _defer_one_per_replica(a: Assignment, enc: np.ndarray, tokens: np.ndarray) -> Assignment:
    """``a`` with, on each replica that defers nothing, the smallest encoded sample (by
    tokens) of a microbatch that holds another consumed one microbatch later."""
    llm_sets = [[s.copy() for s in row] for row in a.llm_sets]
    for r, row in enumerate(a.encoder_sets):
        if any(np.setdiff1d(e, lset).size for e, lset in zip(row, llm_sets[r])):
            continue
        movable = [
            (int(tokens[i]), j, int(i))
            for j in range(a.microbatches - 1)
            if len(llm_sets[r][j]) > 1
            for i in llm_sets[r][j]
            if enc[i] > 0
        ]
        if movable:
            _, j, i = min(movable)
            llm_sets[r][j] = llm_sets[r][j][llm_sets[r][j] != i]
            llm_sets[r][j + 1] = np.sort(np.append(llm_sets[r][j + 1], i))
    return Assignment(a.method, a.dp, a.microbatches, a.encoder_sets, llm_sets, a.carried)


def count_deferred(mbs: list[Microbatch]) -> int:
    return sum(len(mb.deferred_out) for mb in mbs)


def make_model(seed: int = 0, bf16_init: bool = False, **kw: Any) -> ReferenceMLLM:
    """The reference model, seeded; ``bf16_init``: fp32 weights rounded to bf16 values."""
    torch.manual_seed(seed)
    from entrain_data.adapters.reference_model import ReferenceConfig

    model = ReferenceMLLM(ReferenceConfig(**kw))
    if bf16_init:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    return model


@functools.lru_cache(maxsize=8)
def _reference(
    steps: int, mode: str, seed: int, bf16: bool = False, adam: bool = False
) -> dict[str, torch.Tensor]:
    return _train_reference(global_batches(steps), mode, seed, bf16, adam)


ADAM_LR = 1e-2
ADAM_EPS = 1e-3


def make_adam(params: Any) -> torch.optim.Optimizer:
    """The Adam the Adam-only paths (Megatron's distributed optimizer) are compared with:
    betas 0.9/0.999, no weight decay, ``eps`` 1e-3 (not 1e-8): some gradients are zero in exact
    arithmetic (an attention key bias), float noise there, and Adam would turn that noise
    into lr-sized steps; eps above the noise keeps the comparison about real gradients."""
    return torch.optim.AdamW(params, lr=ADAM_LR, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=0.0)


def reference_params_adam(steps: int, bf16: bool = False) -> dict[str, torch.Tensor]:
    """The scenario's unbalanced run with :func:`make_adam` (fp32, or bf16 as
    :func:`reference_params_bf16`)."""
    return _reference(steps, "token", 0, bf16, True)


def reference_params_bf16(steps: int, mode: str = "token") -> dict[str, torch.Tensor]:
    """The scenario's unbalanced run in bf16 mixed precision, as the frameworks run it:
    fp32 master weights, forward and backward on a bf16 copy, gradients to fp32, fp32 SGD.
    The master starts from ``make_model(bf16_init=True)``: DeepSpeed casts the model to bf16
    before it copies the fp32 master, so its master starts bf16-rounded."""
    return _reference(steps, mode, 0, True)


def reference_params(
    batches: list[list[SyntheticSample]], mode: str = "token", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Train on each global batch as ONE microbatch in one process (no balancing), plain SGD.

    Cached for the scenario's own batches (tests compare several runs against it)."""
    if _fingerprint(batches) == _fingerprint(global_batches(len(batches))):
        return _reference(len(batches), mode, seed)
    return _train_reference(batches, mode, seed)


def bf16_noise(steps: int, adam: bool = False) -> float:
    """How far bf16 arithmetic alone moves the scenario's parameters: the unbalanced bf16 run
    against the unbalanced fp32 run from the same (bf16-rounded) initial weights."""
    fp32 = _train_reference(global_batches(steps), "token", 0, False, adam, rounded_init=True)
    bf16 = _reference(steps, "token", 0, True, adam)
    return max(float((bf16[k] - fp32[k]).abs().max()) for k in fp32)


def _fingerprint(batches: list[list[SyntheticSample]]) -> tuple:
    return tuple(
        (
            s.key,
            s.input_ids.numpy().tobytes(),
            s.patches.numpy().tobytes(),
            s.audio.numpy().tobytes(),
        )
        for b in batches
        for s in b
    )


def _train_reference(
    batches: list[list[SyntheticSample]],
    mode: str,
    seed: int,
    bf16: bool = False,
    adam: bool = False,
    rounded_init: bool | None = None,
) -> dict[str, torch.Tensor]:
    model = make_model(seed, bf16_init=bf16 if rounded_init is None else rounded_init)
    compute = make_model(seed).to(torch.bfloat16) if bf16 else model
    opt = make_adam(model.parameters()) if adam else torch.optim.SGD(model.parameters(), lr=LR)
    for it, batch in enumerate(batches):
        samples = {s.key: s for s in batch}
        keys = list(samples)
        mb = pack_microbatch(samples, keys, keys, iteration=it)
        if bf16:
            compute.load_state_dict(model.state_dict())  # rounds the fp32 master to bf16
        loss_sum, count = compute(mb, mode=mode)
        (loss_sum / count).backward()
        if bf16:
            for p, c in zip(model.parameters(), compute.parameters()):
                p.grad, c.grad = c.grad.float(), None
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_params_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 2e-5
) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    init = make_model().state_dict()
    moved = max(float((want[k] - init[k]).abs().max()) for k in want)
    assert moved > 1e-3, "reference did not train: the comparison would prove nothing"
    assert worst < atol, f"parameters differ from the unbalanced reference by {worst:.3g}"


def one_thread() -> Any:
    """Generator for a fixture: torch on one thread (tiny ops on a shared box), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
