"""The demo's training ranks: DDP over gloo on CPU, fed by the loader service, every forward timed."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from entrain_data.errors import WorkerDied
from entrain_data.plan import ParallelPlan

from .model import RANKS, demo_reference_config

__all__ = ["train"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, endpoint: str, out_path: str, seed: int, lr: float) -> None:
    """One training rank: DDP over gloo, microbatches from the loader service, timed forwards."""
    import torch
    import torch.distributed as dist
    from entrain_data.adapters.common import group_iterations
    from entrain_data.adapters.reference_model import ReferenceMLLM
    from entrain_data.adapters.torch import accumulate_gradients

    from entrain_data.client import EntrainLoader

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        torch.manual_seed(seed)
        model = ReferenceMLLM(demo_reference_config())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
        enc_time = {"vision": 0.0, "audio": 0.0}
        starts: dict[str, float] = {}

        def hooks(name: str):
            def pre(_mod, _inp):
                starts[name] = time.thread_time()

            def post(_mod, _inp, _out):
                enc_time[name] += time.thread_time() - starts.pop(name)

            return pre, post

        for name, enc in (("vision", model.vision), ("audio", model.audio)):
            pre, post = hooks(name)
            enc.register_forward_pre_hook(pre)
            enc.register_forward_hook(post)
        records: list[dict[str, Any]] = []
        steps: list[dict[str, Any]] = []

        def forward(m, mb, buffer):
            enc_time["vision"] = enc_time["audio"] = 0.0
            t0, w0 = time.thread_time(), time.perf_counter()
            out = m(mb, buffer)
            total, wall = time.thread_time() - t0, time.perf_counter() - w0
            enc = enc_time["vision"] + enc_time["audio"]
            records.append(
                {
                    "iteration": mb.iteration,
                    "epoch": mb.epoch,
                    "microbatch": mb.microbatch,
                    "replica": mb.replica,
                    "encoder_keys": list(mb.encoder_keys),
                    "llm_keys": list(mb.llm_keys),
                    "encoder_fwd": enc,
                    "vision_fwd": enc_time["vision"],
                    "audio_fwd": enc_time["audio"],
                    "llm_fwd": total - enc,
                    "wall_fwd": wall,
                    "tokens": mb.num_tokens,
                }
            )
            return out

        with EntrainLoader(endpoint, rank, timeout=120.0) as loader:
            for mbs in group_iterations(loader):
                t0 = time.perf_counter()
                res = accumulate_gradients(ddp, mbs, forward)
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps.append(
                    {
                        "epoch": mbs[0].epoch,
                        "iteration": mbs[0].iteration,
                        "seconds": time.perf_counter() - t0,
                        "loss": res.loss,
                    }
                )
        Path(out_path).write_text(
            json.dumps({"rank": rank, "microbatches": records, "steps": steps})
        )
    finally:
        dist.destroy_process_group()


# glibc malloc: keep freed memory in the heap instead of returning it to the OS. Every
# iteration frees and reallocates the same activations; with the defaults each large
# block comes back through fresh page faults, CPU time that lands in whichever forward
# allocates first and swamps the tiny demo encoders' timings (the CPU analogue of
# running PyTorch with jemalloc/tcmalloc). Settings the user made are kept.
_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(512 << 20),
}


@contextlib.contextmanager
def _rank_allocator_env():
    """Spawned rank processes start with :data:`_MALLOC_ENV`; this process's env is restored."""
    added = {k: v for k, v in _MALLOC_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def train(method: str, plan: ParallelPlan, index: Path, out: Path, args) -> list[dict]:
    """Serve ``plan`` with ``method`` and train on 2 ranks; returns each rank's records."""
    import torch.multiprocessing as mp
    from entrain_data.workers.service import start_service

    plan_path = plan.with_method(method).save(out / f"plan-{method}.json")
    results = [out / f"run-{method}-rank{r}.json" for r in range(RANKS)]
    for p in results:
        p.unlink(missing_ok=True)
    service = start_service(
        index=index, plan=plan_path, workers=args.workers, seed=args.seed, epochs=args.epochs
    )
    procs = []
    try:
        port = _free_port()
        ctx = mp.get_context("spawn")
        with _rank_allocator_env():
            for r in range(RANKS):
                p = ctx.Process(
                    target=_rank_main,
                    name=f"entrain-demo-rank{r}",
                    args=(r, port, service.endpoint, str(results[r]), args.seed, args.lr),
                )
                p.start()
                procs.append(p)
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        bad = [p for p in procs if p.exitcode != 0]
        if bad:
            raise WorkerDied(
                f"demo ({method}): rank process(es) {[p.name for p in bad]} failed or timed out "
                f"(exit codes {[p.exitcode for p in bad]}); see the log above"
            )
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        service.close()
    return [json.loads(p.read_text()) for p in results]
