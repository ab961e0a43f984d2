"""FSDP2 with every block wrapped, in bf16, on Entrain-balanced microbatches.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py          # CPU, gloo

The plan says ``sharding="full"`` (ZeRO-3); ``wrap_from_plan`` wraps each encoder
and LLM block with ``fully_shard`` under bf16 mixed precision, and
``accumulate_gradients`` makes the encoder calls group-wide, which per-block
sharding needs. The lines marked ``# entrain`` are what a user adds.
"""

import dataclasses
import logging

import torch
import torch.distributed as dist
from _plan import example_plan
from entrain_data.adapters.common import EncoderOutputBuffer, group_iterations  # entrain
from entrain_data.adapters.fsdp import wrap_from_plan  # entrain
from entrain_data.adapters.reference_model import ReferenceMLLM, synthetic_stream
from entrain_data.adapters.torch import accumulate_gradients, device_mesh_from_plan  # entrain


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = example_plan(dp=dist.get_world_size())  # entrain: ParallelPlan.load("plan.json")
    plan = dataclasses.replace(plan, sharding="full")  # what the planner writes when it pays
    mesh = device_mesh_from_plan(plan)  # entrain
    replica = plan.rank_coords(rank).replica  # entrain
    torch.manual_seed(0)
    model = ReferenceMLLM()
    blocks = [model.vision, model.audio, *model.layers]  # your encoder and LLM blocks
    model = wrap_from_plan(model, plan, mesh, blocks, bf16=True)  # entrain
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    buffer = EncoderOutputBuffer(plan.defer_budget)  # entrain: deferred encoder outputs
    stream = synthetic_stream(plan, replica, steps=5)  # entrain: EntrainLoader(...)
    for mbs in group_iterations(stream):  # entrain: one iteration's microbatches
        res = accumulate_gradients(model, mbs, dp_group=mesh["dp"].get_group(), buffer=buffer)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            logging.info("iteration %d loss %.4f", mbs[0].iteration, res.loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
