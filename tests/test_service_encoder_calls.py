"""The service puts the group-wide encoder calls in every microbatch (``mb.meta["encoder_calls"]``)
and honours the plan's encoder patch cap: what sharded data parallelism (ZeRO-3, per-block FSDP2)
needs from the loader, computed from the assignment ahead of training."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from entrain_data.workers.demo_data import write_demo_dataset
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.service import start_service

from entrain_data.client import EntrainLoader
from entrain_data.cost_model import per_sample_costs
from entrain_data.encoder_calls import ENCODER_CALLS_KEY
from entrain_data.metadata import write_index
from entrain_data.plan import Cluster, StagePlan, StageSegment
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec

pytestmark = pytest.mark.timeout(180)

SPEC = ModelSpec.from_names(["qwen2.5-vl-vision", "whisper-large-v3-encoder"], "llama-3.2-1b")
VIT = StageSegment("qwen2.5-vl-vision", 0, 0, 32, True, True)
AUD = StageSegment("whisper-large-v3-encoder", 1, 0, 32, True, True)
APART = (StagePlan(0, (VIT,)), StagePlan(1, (AUD,)),
         StagePlan(2, (StageSegment("llm", None, 0, 16, True, True),)))  # fmt: skip


def _demo(tmp_path, seed: int, gpus: int):
    """A demo dataset's table and index, and a pp = 1 plan for it on ``gpus`` replicas."""
    shards = write_demo_dataset(tmp_path / "data", samples=48, shards=2, seed=seed)
    table = build_index([str(s) for s in shards], progress=False)
    index = write_index(table, tmp_path / "index.parquet")
    plan = make_plan(table, SPEC, Cluster(gpus), 16, dp=gpus, tp=1, pp=1, microbatches=4, batches=2)
    return table, index, plan


def _serve_all(index, plan, ranks, socket_dir) -> dict:
    """Every rank's whole epoch from a service of ``plan``, stopped however the test ends."""
    svc = start_service(index=index, plan=plan, workers=2, socket_dir=str(socket_dir))
    loaders = [EntrainLoader(svc.endpoint, r, timeout=60) for r in ranks]
    try:
        out = {r: list(ld) for r, ld in zip(ranks, loaders)}
        assert svc.wait(30) == 0
    finally:
        for ld in loaders:
            ld.close()
        svc.close()
    return out


def test_every_microbatch_carries_the_group_wide_encoder_calls(tmp_path):
    table, index, plan = _demo(tmp_path, seed=1, gpus=2)
    assert plan.max_encoder_patches > 0
    out = _serve_all(index, plan, (0, 1), tmp_path / "sock")
    costs = per_sample_costs(table, SPEC)
    row = {str(k): i for i, k in enumerate(table.keys)}
    uses = {"vision": table.image_offsets, "audio": table.audio_offsets}
    by_position = defaultdict(list)
    deferred = 0
    for mbs in out.values():
        for mb in mbs:
            calls = mb.meta[ENCODER_CALLS_KEY]
            by_position[(mb.iteration, mb.microbatch)].append(calls)
            patches = plan.column_costs(costs.encoder_tokens[[row[k] for k in mb.encoder_keys]])
            assert (patches.sum(axis=0) <= plan.max_encoder_patches).all()  # the plan's cap
            for consumers in calls.values():
                assert mb.microbatch in consumers and consumers == sorted(consumers)
            # every deferred sample's consumer is a listed call of each encoder it uses
            consumer = {k: mb2.microbatch for mb2 in mbs if mb2.iteration == mb.iteration
                        for k in mb2.llm_keys}  # fmt: skip
            for k in mb.encoder_keys:
                deferred += consumer[k] != mb.microbatch
                for kind, offsets in uses.items():
                    i = row[k]
                    if offsets[i + 1] > offsets[i]:
                        assert consumer[k] in calls[kind], (k, kind, calls)
    # the same calls on every replica (same collectives on every rank of the group)
    for calls in by_position.values():
        assert len(calls) == 2 and calls[0] == calls[1]
    assert deferred > 0  # the check above saw deferral


def test_encoders_on_their_own_stages_are_capped_per_stage(tmp_path):
    """Encoders on their own stages are a cost column each (``plan.cost_columns``): the
    service gives assign their patches per column, so the plan's patch cap bounds what each
    stage holds, and every sample is served exactly once."""
    table, index, plan = _demo(tmp_path, seed=2, gpus=1)
    plan = replace(plan, world_size=3, pp=3, stages=APART, stage_shares=())
    assert plan.encoder_groups() == [[0], [1]] and plan.max_encoder_patches > 0
    out = _serve_all(index, plan, range(3), tmp_path / "sock")
    patches = per_sample_costs(table, SPEC).encoder_tokens
    row = {str(k): i for i, k in enumerate(table.keys)}
    served = [k for mb in out[0] for k in mb.encoder_keys]
    assert sorted(served) == sorted(str(k) for k in table.keys)
    assert sorted(k for mb in out[2] for k in mb.llm_keys) == sorted(served)
    for mb in out[0]:
        per_stage = patches[[row[k] for k in mb.encoder_keys]].sum(axis=0)
        assert (per_stage <= plan.max_encoder_patches).all(), per_stage


def test_a_replan_that_balances_the_encoders_apart_resumes(tmp_path):
    """Plan A holds both encoders on one stage (one cost column), plan B each on its own (two):
    the same index, seed and global batch cut the same global batches, so a state saved under
    A resumes under B at the start of its iteration instead of being refused as another index."""
    _, index, base = _demo(tmp_path, seed=2, gpus=1)
    together = (StagePlan(0, (VIT, AUD, StageSegment("llm", None, 0, 8, True, False))),
                StagePlan(1, (StageSegment("llm", None, 8, 16, False, True),)))  # fmt: skip
    a = replace(base, world_size=2, pp=2, stages=together, stage_shares=())
    b = replace(base, world_size=3, pp=3, stages=APART, stage_shares=())
    assert a.cost_columns() == [[0, 1]] and b.cost_columns() == [[0], [1]]
    svc = start_service(index=index, plan=a, workers=1, socket_dir=str(tmp_path / "a"))
    loaders = [EntrainLoader(svc.endpoint, r, prefetch=2, timeout=60) for r in (0, 1)]
    try:
        streams = [iter(ld) for ld in loaders]
        for _ in range(6):
            for s in streams:
                next(s)
        state = loaders[0].state_dict()
    finally:
        for ld in loaders:
            ld.close()
        svc.close()
    assert (state["iteration"], state["microbatch"]) == (1, 2)
    svc = start_service(index=index, plan=b, workers=1, socket_dir=str(tmp_path / "b"))
    loader = EntrainLoader(svc.endpoint, 0, prefetch=2, timeout=60)
    try:
        loader.load_state_dict(state)
        mb = next(iter(loader))
    finally:
        loader.close()
        svc.close()
    assert (mb.epoch, mb.iteration, mb.microbatch) == (0, 1, 0)
