"""Megatron-Core GPTModel over 2 pipeline stages (1F1B) on Entrain-balanced microbatches.

Two gloo ranks on CPU run megatron-core 0.16.1's own pipeline schedule
(``get_forward_backward_func()``, 1F1B, ``variable_seq_lengths=True``) on a
tiny ``GPTModel`` (local layer spec, tied input/output embeddings, learned
absolute positions) split by the plan's uneven layer split (1 + 3 layers),
fed by the adapter's ``data_iterator`` / ``make_forward_step`` with per-token
loss. After a few SGD steps each stage's parameters must equal those of the
same initial model trained without pipelining and without balancing: one
process, each global batch as one padded batch (one sample per row, a plain
causal mask, padding masked out of the loss), loss = mean over the
global batch's loss tokens.

Packed sequences: Megatron-Core's local ``DotProductAttention`` refuses
``PackedSeqParams`` (THD needs Transformer Engine, absent on CPU), so the
pipelined run uses ``data_iterator(..., attention="mask")``: each microbatch
is one packed row with a block-diagonal causal ``attention_mask`` and
``position_ids`` restarting per sample. The THD path is not exercised here.

Megatron's CUDA-only calls are pointed at the CPU by the TEST-ONLY
:mod:`_megatron_shim`, installed inside each rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _dist import global_batches, one_thread, replica_microbatches, run_ranks

from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.frameworks

STEPS = 3
MICROBATCHES = 3
LAYERS = [(0, 1), (1, 4)]  # uneven: 1 layer on the first stage, 3 on the last
LR = 0.1
VOCAB = 48  # the synthetic samples' token ids
MAX_POSITIONS = 256
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _plan() -> ParallelPlan:
    stages = tuple(
        StagePlan(i, (StageSegment("llm", None, a, b, i == 0, i == len(LAYERS) - 1),))
        for i, (a, b) in enumerate(LAYERS)
    )
    return ParallelPlan(
        world_size=2, gpus_per_node=8, dp=1, tp=1, pp=2, stages=stages,
        microbatches=MICROBATCHES, global_batch=16, max_tokens=4096, defer_budget=4096,
    )  # fmt: skip


def _config(**settings: object) -> object:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        hidden_size=16, num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, **settings,
    )  # fmt: skip


def _gpt(config: object, pre: bool = True, post: bool = True) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=MAX_POSITIONS,
        pre_process=pre, post_process=post, share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )  # fmt: skip


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _to_reference_name(key: str, layer_offset: int) -> str:
    """A stage's parameter name in the single-stage model (layers renumbered; the last stage's
    copy of the tied embedding is the reference's word embedding)."""
    if key == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return re.sub(
        r"^decoder\.layers\.(\d+)\.",
        lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.",
        key,
    )


def _padded_batch(batch: list) -> dict[str, torch.Tensor]:
    """The global batch without packing: one sample per row, right-padded, padding masked."""
    longest = max(s.llm_tokens for s in batch)
    tokens = torch.zeros(len(batch), longest, dtype=torch.int64)
    labels = torch.zeros_like(tokens)
    loss_mask = torch.zeros(len(batch), longest)
    for row, s in enumerate(batch):
        n = s.llm_tokens
        tokens[row, :n] = s.input_ids
        valid = s.labels != -100
        labels[row, :n] = torch.where(valid, s.labels, 0)
        loss_mask[row, :n] = valid.float()
    positions = torch.arange(longest).expand(len(batch), longest)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "positions": positions}


def _train_reference(model: torch.nn.Module) -> None:
    """One process, no pipeline, no balancing: per-token mean over each whole global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in global_batches(STEPS):
        b = _padded_batch(batch)
        # plain causal mask, what Megatron builds by default (padding follows every real token)
        causal = torch.ones(b["tokens"].shape[1], b["tokens"].shape[1]).triu(1).bool()
        losses = model(b["tokens"], b["positions"], causal[None, None], labels=b["labels"])
        ((losses * b["loss_mask"]).sum() / b["loss_mask"].sum()).backward()
        opt.step()
        opt.zero_grad()


def _gpt_pipeline_rank(rank: int, world: int, out_dir: str) -> None:
    from _megatron_shim import install_cpu_shim
    from entrain_data.adapters.megatron import (
        data_iterator,
        finalize_per_token_grads,
        initialize_from_plan,
        make_forward_step,
        masked_loss_sum,
        max_tokens,
        transformer_settings,
    )
    from entrain_data.adapters.reference_model import pack_microbatch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    install_cpu_shim()
    out = Path(out_dir)
    plan = _plan()

    # the reference: same seed on both ranks, so both hold the same initial model
    parallel_state.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(0)
        reference = _gpt(_config(num_layers=sum(b - a for a, b in LAYERS)))
        init = _params(reference)
        if rank == 0:
            torch.save(init, out / "init.pt")
            _train_reference(reference)
            torch.save(_params(reference), out / "reference.pt")
    finally:
        parallel_state.destroy_model_parallel()

    initialize_from_plan(plan)
    try:
        settings = transformer_settings(plan)
        config = _config(**settings)
        config.finalize_model_grads_func = finalize_per_token_grads
        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()
        stage = _gpt(config, pre=first, post=last)
        offset = 0 if first else settings.get("num_layers_in_first_pipeline_stage", 2)
        names = {k: _to_reference_name(k, offset) for k in _params(stage)}
        stage.load_state_dict({k: init[ref] for k, ref in names.items()}, strict=False)
        assert all(torch.equal(v, init[names[k]]) for k, v in _params(stage).items())

        def step(item: dict, model: torch.nn.Module, _buffer: object) -> torch.Tensor:
            return model(
                item["tokens"], item["position_ids"], item["attention_mask"], labels=item["labels"]
            )

        forward_step = make_forward_step(step, loss_sum=masked_loss_sum)
        fwd_bwd = get_forward_backward_func()
        opt = torch.optim.SGD(stage.parameters(), lr=LR)
        sizes = set()
        for it, batch in enumerate(global_batches(STEPS)):
            mbs = replica_microbatches(batch, it, plan.dp, plan.microbatches)[0]
            if it == 1:  # an empty microbatch (no samples left for it): fed, not skipped
                mbs.insert(1, pack_microbatch({}, [], [], iteration=it, microbatch=len(mbs)))
            sizes.update(mb.num_tokens for mb in mbs)
            losses = fwd_bwd(
                forward_step_func=forward_step,
                data_iterator=data_iterator(mbs, attention="mask"),
                model=[stage],
                num_microbatches=len(mbs),
                seq_length=max_tokens(mbs),
                micro_batch_size=1,
            )
            if last:
                want = sum(mb.num_loss_tokens for mb in mbs)
                assert int(sum(x["count"] for x in losses)) == want
            opt.step()
            opt.zero_grad()
        assert len(sizes) > 1, "microbatches all the same size: nothing variable was exchanged"
        got = {names[k]: v for k, v in _params(stage).items()}
        torch.save(got, out / f"stage{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(200)
def test_gpt_pipeline_balanced_equals_unpipelined(tmp_path: Path) -> None:
    """PP=2 GPTModel (1F1B, variable shapes, per-token loss) == one unbalanced process; one
    iteration has an empty microbatch, which Megatron's attention cannot run on zero tokens
    (``data_iterator`` feeds it as one padding token without loss)."""
    run_ranks(_gpt_pipeline_rank, str(tmp_path), timeout=180)
    want = torch.load(tmp_path / "reference.pt")
    stages = [torch.load(tmp_path / f"stage{r}.pt") for r in range(2)]
    assert "embedding.word_embeddings.weight" in stages[0]
    assert "embedding.word_embeddings.weight" in stages[1]  # the tied copy on the last stage
    covered = set(stages[0]) | set(stages[1])
    assert covered == set(want), sorted(covered ^ set(want))
    init = torch.load(tmp_path / "init.pt")
    moved = max(float((want[k] - init[k]).abs().max()) for k in want)
    assert moved > 1e-3, "the reference did not train: the comparison would prove nothing"
    for r, got in enumerate(stages):
        worst = max(float((got[k] - want[k]).abs().max()) for k in got)
        worst_key = max(got, key=lambda k: float((got[k] - want[k]).abs().max()))
        assert worst < 1e-6, f"stage {r}: {worst_key} differs from the reference by {worst:.3g}"


def test_mask_items_attend_per_sample() -> None:
    """``attention="mask"``: the mask blocks everything but earlier tokens of the same sample;
    labels without loss become 0 (Megatron's cross entropy has no ignore index)."""
    from entrain_data.adapters.megatron import data_iterator
    from entrain_data.adapters.reference_model import packed_causal_mask

    from entrain_data.errors import InvalidInput

    mbs = replica_microbatches(global_batches(1)[0], 0, 1, MICROBATCHES)[0]
    for mb, item in zip(mbs, data_iterator(mbs, attention="mask")):
        assert "packed_seq_params" not in item
        assert torch.equal(item["attention_mask"][0, 0], ~packed_causal_mask(mb["cu_seqlens"]))
        valid = mb["labels"] != -100
        assert torch.equal(item["loss_mask"][0].bool(), valid)
        assert int(item["labels"].min()) >= 0
        assert torch.equal(item["labels"][0][valid], mb["labels"][valid])
    thd = next(data_iterator(mbs))
    assert "attention_mask" not in thd and thd["packed_seq_params"].qkv_format == "thd"
    with pytest.raises(InvalidInput, match="attention"):
        next(data_iterator(mbs, attention="bshd"))
