"""Plain PyTorch DDP on Entrain-balanced microbatches.

    torchrun --nproc-per-node 2 examples/train_torch_ddp.py          # CPU, gloo

The lines marked ``# entrain`` are what a user adds to an existing DDP script.
Here the microbatches come from ``synthetic_stream`` (the same assignment the
loader service runs); a real job iterates ``EntrainLoader`` instead.
"""

import logging

import torch
import torch.distributed as dist
from _plan import example_plan
from entrain_data.adapters.common import EncoderOutputBuffer, group_iterations  # entrain
from entrain_data.adapters.reference_model import ReferenceMLLM, synthetic_stream
from entrain_data.adapters.torch import accumulate_gradients, device_mesh_from_plan  # entrain
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = example_plan(dp=dist.get_world_size())  # entrain: ParallelPlan.load("plan.json")
    mesh = device_mesh_from_plan(plan)  # entrain
    replica = plan.rank_coords(rank).replica  # entrain
    torch.manual_seed(0)
    model = DDP(ReferenceMLLM(), process_group=mesh["dp"].get_group())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    buffer = EncoderOutputBuffer(plan.defer_budget)  # entrain: deferred encoder outputs
    stream = synthetic_stream(plan, replica, steps=5)  # entrain: EntrainLoader(...)
    for mbs in group_iterations(stream):  # entrain: one iteration's microbatches
        res = accumulate_gradients(model, mbs, dp_group=mesh["dp"].get_group(), buffer=buffer)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            logging.info(
                "iteration %d loss %.4f (%d loss tokens)",
                mbs[0].iteration,
                res.loss,
                res.loss_count,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
