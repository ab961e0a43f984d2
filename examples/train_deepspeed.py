"""DeepSpeed ZeRO on Entrain-balanced microbatches.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/train_deepspeed.py     # CPU, gloo

Lines marked ``# entrain`` are what a user adds to an existing DeepSpeed script.
"""

import logging

import deepspeed
import torch
from _plan import example_plan
from entrain_data.adapters.common import EncoderOutputBuffer, group_iterations  # entrain
from entrain_data.adapters.deepspeed import (
    avoid_cpu_op_builds,
    deepspeed_config,
    train_step,
)  # entrain
from entrain_data.adapters.reference_model import ReferenceMLLM, synthetic_stream


def main() -> None:
    avoid_cpu_op_builds()  # CPU only: skip the shared-memory comm op build
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    plan = example_plan(dp=world)  # entrain: ParallelPlan.load("plan.json")
    config = deepspeed_config(  # entrain: micro batch + accumulation from the plan
        plan, {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    )
    torch.manual_seed(0)
    model = ReferenceMLLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    buffer = EncoderOutputBuffer(plan.defer_budget)  # entrain
    replica = plan.rank_coords(rank).replica  # entrain
    for mbs in group_iterations(synthetic_stream(plan, replica, steps=5)):  # entrain: EntrainLoader
        # entrain: every microbatch's forward/backward, one gradient reduction and one step
        loss = train_step(engine, mbs, buffer=buffer)
        if rank == 0:
            logging.info("iteration %d loss %.4f", mbs[0].iteration, loss)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
