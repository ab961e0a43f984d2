"""Encoder-only pipeline stages through Megatron-Core 0.16.1's multi-module machinery.

A plan whose first stage holds only the encoders (vision + audio) and whose
second holds the LLM becomes two ``HyperCommGrid`` modules (encoder ranks, LLM
ranks) joined by Megatron's ``MultiModulePipelineCommunicator`` (its
``BridgeCommunicator`` carries the encoder output forward and its gradient
back). On 2 gloo CPU ranks (encoder on rank 0, LLM on rank 1) the reference
MLLM trains for a few SGD steps on Entrain-balanced microbatches with deferral
(a sample encoded in microbatch i may reach the LLM in microbatch j > i; the LLM
rank buffers its encoder output, and its gradient goes back once every consumer
has run); the gradients of the first step and the parameters after the last
must equal one process training on each whole global batch.

0.16.1 has no schedule that drives the multi-module communicator (see the
adapter's docstring), so the ranks run the microbatches themselves: all
forwards, then all backwards. Megatron's CUDA-only calls, and the bridge's
hard-coded ``nccl`` groups, are pointed at the CPU/gloo by the TEST-ONLY
:func:`_megatron_shim.install_multimodule_cpu_shim`.
"""

from __future__ import annotations

import dataclasses
import types
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

from entrain_data.errors import InvalidInput, PlanError
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.frameworks

STEPS = 3
MICROBATCHES = 3
ENC = "vision+audio"
ENCODER_PREFIXES = ("vision.", "audio.")
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _enc_stage(i: int) -> StagePlan:
    return StagePlan(
        i, (StageSegment("vision", 0, 0, 1, True, True), StageSegment("audio", 1, 0, 1, True, True))
    )


def _llm_stage(i: int, a: int, b: int, n: int = 4) -> StagePlan:
    return StagePlan(i, (StageSegment("llm", None, a, b, a == 0, b == n),))


def _plan(stages: tuple[StagePlan, ...] | None = None, dp: int = 1, tp: int = 1) -> ParallelPlan:
    stages = stages or (_enc_stage(0), _llm_stage(1, 0, 4))
    pp = len(stages)
    return ParallelPlan(
        world_size=dp * tp * pp, gpus_per_node=8, dp=dp, tp=tp, pp=pp, stages=stages,
        microbatches=MICROBATCHES, global_batch=16, max_tokens=4096, defer_budget=4096,
    )  # fmt: skip


def _groups_from_coords(plan: ParallelPlan, ranks: list[int], dim: str) -> list[list[int]]:
    """The plan's own groups over ``ranks``: ranks equal in every coordinate but ``dim``,
    ordered along ``dim``."""
    fields = {"tp": "tp_rank", "dp": "replica", "pp": "stage"}
    coords = {r: plan.rank_coords(r)._asdict() for r in ranks}
    groups: dict[tuple, list[int]] = {}
    for r in ranks:
        key = tuple(v for k, v in coords[r].items() if k != fields[dim])
        groups.setdefault(key, []).append(r)
    return sorted(sorted(g, key=lambda r: coords[r][fields[dim]]) for g in groups.values())


# --------------------------------------------------------------- no processes needed
def test_grids_follow_rank_coords(monkeypatch: pytest.MonkeyPatch) -> None:
    """tp=2 x dp=2, 2 encoder stages + 2 LLM stages: each grid's tp/dp/pp groups are exactly
    the plan's ranks that share the other coordinates, pipeline groups in stage order."""
    from entrain_data.adapters.megatron_multimodule import (
        llm_transformer_settings,
        module_grids_from_plan,
        module_layouts,
        module_topology,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    stages = (_enc_stage(0), _enc_stage(1), _llm_stage(2, 0, 1), _llm_stage(3, 1, 4))
    plan = _plan(stages, dp=2, tp=2)
    monkeypatch.setenv("WORLD_SIZE", str(plan.world_size))
    layouts = module_layouts(plan)
    assert list(layouts) == [ENC, "llm"]
    assert layouts[ENC].ranks == list(range(8)) and layouts["llm"].ranks == list(range(8, 16))
    assert all(plan.rank_coords(r).stage in (0, 1) for r in layouts[ENC].ranks)
    assert module_topology(layouts) == {ENC: ["llm"], "llm": []}
    grids = module_grids_from_plan(plan, create_groups=False)
    for name, grid in grids.items():
        for dim in ("tp", "dp", "pp"):
            got = sorted(grid.get_rank_enum(dim))
            assert got == _groups_from_coords(plan, layouts[name].ranks, dim), (name, dim)
    s = llm_transformer_settings(plan)
    assert s["pipeline_model_parallel_size"] == 2 and s["num_layers"] == 4
    assert (s["num_layers_in_first_pipeline_stage"], s["num_layers_in_last_pipeline_stage"]) == (
        1,
        3,
    )
    cfg = TransformerConfig(
        hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, **s,
    )  # fmt: skip
    assert cfg.pipeline_model_parallel_size == 2 and cfg.tensor_model_parallel_size == 2


def test_multimodule_validation_names_the_field() -> None:
    from entrain_data.adapters.megatron import transformer_settings
    from entrain_data.adapters.megatron_multimodule import (
        module_grids_from_plan,
        module_layouts,
        multimodule_communicator,
    )

    with pytest.raises(PlanError, match="module_grids_from_plan"):
        transformer_settings(_plan())
    llm_first = (_llm_stage(0, 0, 2), _enc_stage(1), _llm_stage(2, 2, 4))
    with pytest.raises(PlanError, match=r"plan\.stages\[0\] holds LLM layers"):
        module_layouts(_plan(llm_first))
    late_enc = (_enc_stage(0), _llm_stage(1, 0, 2), _enc_stage(2), _llm_stage(3, 2, 4))
    with pytest.raises(PlanError, match=r"plan\.stages\[2\] is encoder-only"):
        module_layouts(_plan(late_enc))
    with pytest.raises(PlanError, match=r"plan\.stages: all 2 stages are encoder-only"):
        module_layouts(_plan((_enc_stage(0), _enc_stage(1))))
    riding = StagePlan(
        2,
        (StageSegment("audio", 1, 0, 1, True, True), StageSegment("llm", None, 2, 4, False, True)),
    )
    with pytest.raises(PlanError, match=r"plan\.stages\[2\]\.segments .*'audio'"):
        module_layouts(_plan((_enc_stage(0), _llm_stage(1, 0, 2), riding)))
    ok = dataclasses.replace(
        riding, index=1, segments=(riding.segments[0], _llm_stage(1, 0, 4).segments[0])
    )
    assert module_layouts(_plan((_enc_stage(0), ok)))["llm"].stages == (1,)
    with pytest.raises(InvalidInput, match="encoder_name and llm_name"):
        module_layouts(_plan(), encoder_name="llm")
    with pytest.raises(InvalidInput, match="not initialised"):
        module_grids_from_plan(_plan())
    cfg = types.SimpleNamespace(pipeline_dtype=None, variable_seq_lengths=True)
    with pytest.raises(InvalidInput, match=r"config\.pipeline_dtype"):
        multimodule_communicator(_plan(), cfg, {})
    cfg = types.SimpleNamespace(pipeline_dtype=torch.float32, variable_seq_lengths=False)
    with pytest.raises(InvalidInput, match=r"config\.variable_seq_lengths"):
        multimodule_communicator(_plan(), cfg, {})


# ------------------------------------------------------------------ 2 gloo ranks
def _encoder_rows(mb: object) -> list[int]:
    """Encoder output rows of each encoder-set sample (one per patch and per audio frame)."""
    rows = [0] * len(mb.encoder_keys)
    if "image_grid_thw" in mb:
        for owner, n in zip(mb["image_sample"].tolist(), mb["image_grid_thw"].prod(1).tolist()):
            rows[owner] += n
    if "audio_lengths" in mb:
        for owner, n in zip(mb["audio_sample"].tolist(), mb["audio_lengths"].tolist()):
            rows[owner] += n
    return rows


def _own_params(model: torch.nn.Module, encoder: bool) -> dict[str, torch.nn.Parameter]:
    return {k: p for k, p in model.named_parameters() if k.startswith(ENCODER_PREFIXES) == encoder}


def _multimodule_rank(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist
    from _megatron_shim import install_multimodule_cpu_shim
    from entrain_data.adapters.common import EncoderOutputBuffer, loss_units
    from entrain_data.adapters.megatron_multimodule import (
        module_grids_from_plan,
        module_layouts,
        multimodule_communicator,
    )
    from entrain_data.adapters.reference_model import Segments
    from megatron.core.model_parallel_config import ModelParallelConfig

    install_multimodule_cpu_shim()
    plan = _plan()
    out = Path(out_dir)
    encoder = rank == 0

    # the grids' process groups are the plan's ranks
    grids = module_grids_from_plan(plan)
    layouts = module_layouts(plan)
    assert list(grids) == [ENC, "llm"]
    for name, grid in grids.items():
        member = rank in layouts[name].ranks
        for dim in ("tp", "cp", "dp", "pp"):
            pg = grid.get_pg(dim)
            if not member:
                assert pg is None, (name, dim)
                continue
            want = [g for g in _groups_from_coords(plan, layouts[name].ranks, "pp") if rank in g]
            want = want[0] if dim == "pp" else [rank]  # dp = tp = cp = 1: alone in those
            assert dist.get_process_group_ranks(pg) == want, (name, dim)

    config = ModelParallelConfig(pipeline_dtype=torch.float32, variable_seq_lengths=True)
    comm = multimodule_communicator(plan, config, grids)
    assert list(comm.rank_module_map) == [ENC if encoder else "llm"]
    assert comm.is_pp_first_stage == encoder and comm.is_pp_last_stage == (not encoder)

    model = make_model()
    params = _own_params(model, encoder)
    opt = torch.optim.SGD(params.values(), lr=LR)
    deferred = 0
    shapes = set()
    for it, batch in enumerate(global_batches(STEPS)):
        mbs = replica_microbatches(batch, it, plan.dp, plan.microbatches)[0]
        deferred += count_deferred(mbs)
        count = sum(loss_units(mb) for mb in mbs)
        if encoder:
            sent = []
            for mb in mbs:  # all forwards: E_j's outputs, [rows, 1, hidden], to the LLM rank
                encoded = model.encode(mb)
                x = torch.cat([encoded[k] for k in mb.encoder_keys])[:, None]
                comm.send_forward({ENC: x})
                sent.append(x)
            for x in reversed(sent):  # all backwards: each E_j's gradient, once complete
                grad = comm.recv_backward()[ENC]
                assert grad.shape == x.shape
                if x.requires_grad:
                    x.backward(grad)
        else:
            buffer = EncoderOutputBuffer(plan.defer_budget)
            received, total = [], torch.zeros(())
            for mb in mbs:
                x = comm.recv_forward()[ENC]
                shapes.add(tuple(x.shape))
                if it == 0:  # same initial weights here: the activations arrived intact
                    encoded = model.encode(mb)
                    want = torch.cat([encoded[k] for k in mb.encoder_keys])[:, None]
                    torch.testing.assert_close(x.detach(), want.detach(), rtol=0, atol=0)
                x = x.detach().requires_grad_()
                received.append(x)
                pieces = dict(zip(mb.encoder_keys, x[:, 0].split(_encoder_rows(mb))))
                for key in mb.deferred_out:  # L part later: hold the output (and its grad path)
                    buffer.put(key, pieces.pop(key), iteration=it)
                for key in mb.deferred_in:
                    pieces[key] = buffer.pop(key, iteration=it)
                h = model.embed(mb, pieces)
                segments = Segments(torch.diff(mb["cu_seqlens"].long()).tolist(), causal=True)
                for layer in model.layers:
                    h = layer(h, segments)
                total = total + model.head_loss(h, mb)[0]
            buffer.check_drained(it)
            (total / count).backward()
            for x in reversed(received):
                comm.send_backward({ENC: x.grad if x.grad is not None else torch.zeros_like(x)})
        if it == 0:
            grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
            torch.save(grads, out / f"grads{rank}.pt")
        opt.step()
        opt.zero_grad()
    if not encoder:
        assert deferred > 0, "no sample was deferred: the buffer path went untested"
        assert len(shapes) > 1, "every microbatch sent the same shape: nothing variable crossed"
    torch.save({k: p.detach().clone() for k, p in params.items()}, out / f"params{rank}.pt")


def _reference_first_grads() -> dict[str, torch.Tensor]:
    """Gradients of the first global batch trained as one microbatch in one process."""
    from entrain_data.adapters.reference_model import pack_microbatch

    model = make_model()
    samples = {s.key: s for s in global_batches(1)[0]}
    loss_sum, count = model(pack_microbatch(samples, list(samples), list(samples)))
    (loss_sum / count).backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_encoder_stage_and_llm_stage_through_the_bridge(tmp_path: Path) -> None:
    """Rank 0 = encoder module, rank 1 = LLM module: the bridge carries activations and
    gradients; grads after step 1 and params after step 3 equal one unbalanced process."""
    run_ranks(_multimodule_rank, str(tmp_path), timeout=100)
    want_grads = _reference_first_grads()
    for rank, encoder in ((0, True), (1, False)):
        got = torch.load(tmp_path / f"grads{rank}.pt")
        names = {k for k in want_grads if k.startswith(ENCODER_PREFIXES) == encoder}
        assert set(got) == names, sorted(set(got) ^ names)
        worst = max(float((got[k] - want_grads[k]).abs().max()) for k in got)
        assert worst < 1e-6, f"rank {rank}: first-step gradients differ by {worst:.3g}"
    params = {**torch.load(tmp_path / "params0.pt"), **torch.load(tmp_path / "params1.pt")}
    assert_params_close(params, reference_params(global_batches(STEPS)))
