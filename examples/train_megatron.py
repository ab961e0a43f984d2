"""Megatron-Core GPTModel, pipeline-parallel (1F1B), on Entrain-balanced microbatches.

    torchrun --nproc-per-node 2 examples/train_megatron.py     # GPUs: 2 pipeline stages
    torchrun --nproc-per-node 4 examples/train_megatron.py     # 2 replicas x 2 stages

Lines marked ``# entrain`` are what a user adds to an existing Megatron-Core
script (built against megatron-core 0.16.1). Megatron-Core's schedules need
CUDA; ``tests/test_example_megatron.py`` runs :func:`main` on CPU with two gloo
ranks through a test-only shim. Here the microbatches come from
``synthetic_stream`` (the same assignment the loader service runs); a real job
iterates ``EntrainLoader`` instead.

Attention: the local layer spec below takes each packed microbatch as one row
with a block-diagonal causal mask (``attention="mask"``, learned absolute
positions restarting per sample). With Transformer Engine, build the model
with ``get_gpt_layer_with_transformer_engine_spec()`` and pass
``data_iterator(mbs)`` items' ``packed_seq_params`` (THD) instead of the mask.
"""

import logging
import os

import torch
import torch.distributed as dist
from _plan import example_plan
from entrain_data.adapters.common import group_iterations  # entrain
from entrain_data.adapters.megatron import (  # entrain
    data_iterator,
    finalize_per_token_grads,
    initialize_from_plan,
    make_forward_step,
    masked_loss_sum,
    max_tokens,
    transformer_settings,
)
from entrain_data.adapters.reference_model import ReferenceConfig, synthetic_stream
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig


def gpt_step(item: dict, model: torch.nn.Module, _buffer: object) -> torch.Tensor:
    """One microbatch through this stage: hidden states, or per-token losses on the last stage."""
    return model(
        item["tokens"], item["position_ids"], item["attention_mask"], labels=item["labels"]
    )


def main(steps: int = 5) -> list[float]:
    """Train for ``steps`` iterations; the per-token loss of each global batch (last stage)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    own_group = not dist.is_initialized()  # a launcher may have initialised it already
    if own_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = 2 if world % 2 == 0 else 1
    plan = example_plan(dp=world // pp, pp=pp)  # entrain: ParallelPlan.load("plan.json")
    initialize_from_plan(plan)  # entrain: TP/PP/DP groups, microbatch calculator
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not cuda,
        pipeline_dtype=torch.float32,
        **transformer_settings(plan),  # entrain: layer split, variable shapes, per-token loss
    )
    config.finalize_model_grads_func = finalize_per_token_grads  # entrain
    last = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=ReferenceConfig().vocab,
        max_sequence_length=512,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=last,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward_step = make_forward_step(gpt_step, loss_sum=masked_loss_sum)  # entrain
    fwd_bwd = get_forward_backward_func()
    replica = plan.rank_coords(rank).replica  # entrain
    history = []
    for mbs in group_iterations(synthetic_stream(plan, replica, steps=steps)):  # entrain
        mbs = [mb.to(device) for mb in mbs]
        losses = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=data_iterator(mbs, attention="mask"),  # entrain
            model=[model],
            num_microbatches=len(mbs),  # entrain: this iteration's microbatches
            seq_length=max_tokens(mbs),  # entrain: variable shapes are exchanged per microbatch
            micro_batch_size=1,
        )
        opt.step()
        opt.zero_grad()
        if last:  # the global batch's per-token loss: sums over this replica, then over DP
            loss_sum = sum(float(x["loss_sum"]) for x in losses)
            count = sum(int(x["count"]) for x in losses)
            total = torch.tensor([loss_sum, count], dtype=torch.float64, device=device)
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            history.append(float(total[0] / total[1]))
            if parallel_state.get_data_parallel_rank() == 0:
                logging.info("iteration %d loss %.4f", mbs[0].iteration, history[-1])
    parallel_state.destroy_model_parallel()
    if own_group:
        dist.destroy_process_group()
    return history


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
