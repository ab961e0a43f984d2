"""DeepSpeed adapter against the real DeepSpeed (CPU accelerator, gloo, 2 ranks).

One spawn trains ZeRO-1 and ZeRO-2 engines (dp=2) and a 2-stage PipelineModule
(pp=2) on Entrain-balanced microbatches with deferral, and builds a
``dynamic_shape=False`` pipeline to check the refusal; the tests read its results.

Balanced microbatches give the two ranks different autograd graphs (other
modalities, deferred encoder outputs), so their ZeRO-2 gradient hooks fire in
different orders; the ZeRO runs check that ``train_step`` does not let DeepSpeed
sum one rank's gradient of a parameter with the other rank's gradient of another.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import (
    LR,
    assert_params_close,
    global_batches,
    make_model,
    one_thread,
    reference_params,
    replica_microbatches,
    run_ranks,
)
from entrain_data.adapters.reference_model import SyntheticSample, synthetic_samples

from entrain_data.errors import InvalidInput, PlanError
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

pytest.importorskip("deepspeed")

STEPS = 3
MICROBATCHES = 3
DS_ENV = {"DS_ACCELERATOR": "cpu"}

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _plan(dp: int, pp: int) -> ParallelPlan:
    layers = [(0, 1), (1, 4)] if pp == 2 else [(0, 4)]
    stages = tuple(
        StagePlan(i, (StageSegment("llm", None, a, b, i == 0, i == pp - 1),))
        for i, (a, b) in enumerate(layers)
    )
    return ParallelPlan(
        world_size=dp * pp, gpus_per_node=8, dp=dp, tp=1, pp=pp, stages=stages,
        microbatches=MICROBATCHES, global_batch=16, max_tokens=4096, defer_budget=4096,
    )  # fmt: skip


def _audio_once_batches(steps: int = STEPS) -> list[list[SyntheticSample]]:
    """Global batches where one sample has audio: one replica's whole step leaves the audio
    encoder without a gradient (with no dummy touch), the other's does not."""
    out = []
    for i in range(steps):
        pool = synthetic_samples(24, seed=100 + i, prefix=f"a{i}-")
        plain = [s for j, s in enumerate(pool) if j % 4 in (0, 3)]  # images or text only
        audio = next(s for j, s in enumerate(pool) if j % 4 == 2)  # audio only
        out.append(plain[:15] + [audio])
    return out


def _zero(
    rank: int,
    world: int,
    stage: int,
    microbatches: int = MICROBATCHES,
    batches: list[list[SyntheticSample]] | None = None,
    touch: bool = True,
    deferral: bool = True,
    fail_first: bool = False,
) -> tuple[dict, list[str]]:
    """Final parameters, and the order in which this rank's parameter gradients arrived.
    ``deferral``: the batches defer samples on this rank (checked through the buffer).
    ``fail_first``: before training, an iteration whose forward raises in microbatch 1 (the
    error caught, as a job that skips a bad batch would); it must leave no trace."""
    import deepspeed
    from entrain_data.adapters.common import EncoderOutputBuffer
    from entrain_data.adapters.deepspeed import deepspeed_config, train_step

    model = make_model()
    if not touch:  # unused encoders get no gradient at all (their dummy touch is exactly 0)
        model.dummy_touch = lambda: 0.0
    plan = dataclasses.replace(_plan(dp=world, pp=1), microbatches=microbatches)
    config = deepspeed_config(
        plan, {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    order: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    buffer = EncoderOutputBuffer(4096)
    if fail_first:
        _failed_iteration(engine, rank, world, microbatches, buffer)
    for it, batch in enumerate(batches or global_batches(STEPS)):
        mbs = replica_microbatches(batch, it, world, microbatches)[rank]
        assert train_step(engine, mbs, buffer=buffer) > 0
    assert buffer.peak_tokens > 0 or microbatches == 1 or not deferral, "no deferral"
    assert engine.global_steps == STEPS, engine.global_steps
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, order


def _failed_iteration(
    engine: object, rank: int, world: int, microbatches: int, buffer: object
) -> None:
    from entrain_data.adapters.deepspeed import train_step

    def failing(engine: object, mb: object, buf: object) -> object:
        if mb.microbatch == 1:
            raise RuntimeError("bad sample in microbatch 1")
        return engine(mb, buf)

    batch = global_batches(1, seed=50)[0]  # not one of the batches trained on
    mbs = replica_microbatches(batch, 0, world, microbatches)[rank]
    with pytest.raises(RuntimeError, match="bad sample"):
        train_step(engine, mbs, forward=failing, buffer=buffer)


def _pipe(rank: int, world: int, dynamic: bool) -> dict:
    import deepspeed
    from entrain_data.adapters.deepspeed import (
        PipelineFeeder,
        PlannedPipelineModule,
        deepspeed_config,
    )

    plan = _plan(dp=1, pp=world)
    model = make_model()
    feeder = PipelineFeeder(model, budget=4096)
    net = PlannedPipelineModule(
        feeder.layers(), plan=plan, loss_fn=feeder.loss_fn, dynamic_shape=dynamic
    )
    opt = torch.optim.SGD([p for p in net.parameters()], lr=LR)
    config = deepspeed_config(plan, {"zero_allow_untested_optimizer": True})  # ZeRO-1: plan
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    if not dynamic:
        try:
            feeder.train_batch(
                engine, replica_microbatches(global_batches(1)[0], 0, 1, MICROBATCHES)[0]
            )
        except InvalidInput as exc:
            return {"refused": str(exc)}
        return {"refused": ""}
    for it, batch in enumerate(global_batches(STEPS)):
        loss = feeder.train_batch(engine, replica_microbatches(batch, it, 1, MICROBATCHES)[0])
        assert (loss > 0) == engine.is_last_stage(), loss
    owned = {id(p) for p in net.parameters()}
    names = {n for n, p in model.named_parameters() if id(p) in owned}
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}


def _ds_rank(rank: int, world: int, out: str) -> None:
    import deepspeed
    from entrain_data.adapters.deepspeed import avoid_cpu_op_builds

    avoid_cpu_op_builds()
    deepspeed.init_distributed(dist_backend="gloo")
    zero2, zero2_order = _zero(rank, world, 2)
    results = {
        "zero0": _zero(rank, world, 0)[0],
        "zero1": _zero(rank, world, 1)[0],
        "zero0-failed": _zero(rank, world, 0, fail_first=True)[0],
        "zero2-failed": _zero(rank, world, 2, fail_first=True)[0],
        "zero2": zero2,
        "zero2-order": zero2_order,
        "zero2-gas1": _zero(rank, world, 2, microbatches=1)[0],
        # about unused encoders, not deferral: the assignment defers on one rank only here
        "zero2-unused": _zero(
            rank, world, 2, batches=_audio_once_batches(), touch=False, deferral=False
        )[0],
        "pipe": _pipe(rank, world, dynamic=True),
        "static": _pipe(rank, world, dynamic=False),
    }
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def ds_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ds") / "ds.pt"
    run_ranks(_ds_rank, str(out), timeout=240, env=DS_ENV)
    return [torch.load(f"{out}.{r}") for r in range(2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["zero0", "zero1", "zero2-gas1", "zero0-failed", "zero2-failed"])
def test_zero_balanced_equals_unbalanced(ds_results: list[dict], run: str) -> None:
    """ZeRO-0 and ZeRO-1 with 3 variable-size microbatches per replica (deferral, accumulation);
    ZeRO-2 with one microbatch per replica (replicas of different sizes). ``-failed``: after
    an iteration that raised in its second microbatch (ZeRO-0 used to count that iteration's
    microbatches toward the next boundary, stepping mid-iteration from then on)."""
    want = reference_params(global_batches(STEPS))
    for rank in range(2):
        assert_params_close(ds_results[rank][run], want)


@pytest.mark.timeout(300)
def test_zero2_accumulation_balanced_equals_unbalanced(ds_results: list[dict]) -> None:
    """ZeRO-2, 3 microbatches per replica. The ranks' gradients arrive in different orders
    (checked), which DeepSpeed's per-microbatch ZeRO-2 bucket reduction cannot take."""
    orders = [ds_results[rank]["zero2-order"] for rank in range(2)]
    assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1], (
        "both ranks' gradients arrived in one order: the test would not show the hazard"
    )
    want = reference_params(global_batches(STEPS))
    for rank in range(2):
        assert_params_close(ds_results[rank]["zero2"], want)


@pytest.mark.timeout(300)
def test_zero2_parameter_without_gradient_on_one_rank(ds_results: list[dict]) -> None:
    """No dummy touch and audio in one replica only: that step, the other rank's audio
    encoder has no gradient at all; the reduction must still line up."""
    batches = _audio_once_batches()
    one_sided = 0
    for it, batch in enumerate(batches):
        has_audio = [
            any("audio_features" in mb for mb in mbs)
            for mbs in replica_microbatches(batch, it, 2, MICROBATCHES)
        ]
        one_sided += has_audio.count(True) == 1
    assert one_sided, "no step leaves one replica without audio: the test would prove nothing"
    want = reference_params(batches)
    for rank in range(2):
        assert_params_close(ds_results[rank]["zero2-unused"], want)


@pytest.mark.timeout(300)
def test_pipeline_two_stages_balanced_equals_unbalanced(ds_results: list[dict]) -> None:
    first, last = ds_results[0]["pipe"], ds_results[1]["pipe"]
    assert first and last and not set(first) & set(last)
    assert any(k.startswith("vision.") for k in first) and "lm_head.weight" in last
    assert_params_close({**first, **last}, reference_params(global_batches(STEPS)))


@pytest.mark.timeout(300)
def test_pipeline_refuses_static_shapes(ds_results: list[dict]) -> None:
    for rank in range(2):
        assert "dynamic_shape=True" in ds_results[rank]["static"]["refused"]


def test_config_from_plan_merges_and_refuses_conflicts() -> None:
    from entrain_data.adapters.deepspeed import deepspeed_config, pipeline_parts

    plan = _plan(dp=2, pp=1)
    cfg = deepspeed_config(plan, {"zero_optimization": {"stage": 2}})
    assert cfg["gradient_accumulation_steps"] == MICROBATCHES
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * MICROBATCHES * 2
    assert cfg["zero_optimization"] == {"stage": 2}
    with pytest.raises(InvalidInput, match="gradient_accumulation_steps"):
        deepspeed_config(plan, {"gradient_accumulation_steps": 8})
    assert pipeline_parts(_plan(dp=1, pp=2)) == [0, 2, 6]
    enc_only = StagePlan(0, (StageSegment("vit", 0, 0, 2, True, True),))
    llm = StagePlan(1, (StageSegment("llm", None, 0, 4, True, True),))
    bad = ParallelPlan(
        world_size=2, gpus_per_node=8, dp=1, tp=1, pp=2, stages=(enc_only, llm),
        microbatches=3, global_batch=16, max_tokens=4096, defer_budget=0,
    )  # fmt: skip
    with pytest.raises(PlanError, match="holds no LLM layers"):
        pipeline_parts(bad)


def test_reference_layers_match_model() -> None:
    """The pipe layers, run in sequence on one process, compute the model's own loss."""
    from entrain_data.adapters.deepspeed import PipelineFeeder

    model = make_model()
    feeder = PipelineFeeder(model)
    mbs = replica_microbatches(global_batches(1)[0], 0, 1, MICROBATCHES)[0]
    feeder.current, feeder.scale = mbs, 1.0
    total = 0.0
    for j, mb in enumerate(mbs):
        x = torch.tensor(j)
        for layer in feeder.layers():
            x = layer(x)
        total += float(feeder.loss_fn(x, (mb["labels"], mb["cu_seqlens"])))
    samples = {s.key: s for s in global_batches(1)[0]}
    from entrain_data.adapters.reference_model import pack_microbatch

    whole = pack_microbatch(samples, list(samples), list(samples))
    assert abs(total - float(model(whole)[0])) < 1e-3
