"""A plan made from an index serves every global batch of that index, or says at plan time why not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from entrain_data.workers.schedule import epoch_batches

from entrain_data.assignment import assign
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import PlanError
from entrain_data.metadata import write_index
from entrain_data.plan import Cluster
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.workloads import synthesize

SPEC = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")


def _serve_every_batch(table, plan, seed: int, epochs: int) -> int:
    """Assign every global batch the service would cut in ``epochs`` epochs; returns how many."""
    costs = per_sample_costs(table, SPEC)
    enc, llm, tok = costs.encoder_cost(), costs.llm_cost(), costs.llm_tokens
    patches = costs.encoder_tokens.astype(np.int64)
    done = 0
    for epoch in range(epochs):
        for i, b in enumerate(
            epoch_batches(len(table), plan.global_batch, plan.dp * plan.microbatches, seed, epoch)
        ):
            assign(
                enc[b],
                llm[b],
                tok[b],
                dp=plan.dp,
                microbatches=plan.microbatches,
                max_tokens=plan.max_tokens,
                defer_budget=plan.defer_budget,
                encoder_patches=patches[b],
                max_encoder_patches=plan.max_encoder_patches or None,
                seed=seed,
                iteration=epoch * 1000 + i,
            )
            done += 1
    return done


@pytest.mark.parametrize(
    ("workload", "samples", "batch", "microbatches"),
    [
        ("text-heavy", 600, 16, 1),
        ("qwen2vl-dynamic", 400, 32, 2),
        ("text-heavy", 25, 8, 1),
        ("text-heavy", 512, 128, 8),  # documents: many samples above half a mean encoder set
    ],
)
def test_plan_serves_every_batch_of_its_index(workload, samples, batch, microbatches):
    table = synthesize(workload, samples, seed=3)
    plan = make_plan(
        table, SPEC, Cluster(2, 2, 80.0), batch, dp=2, tp=1, pp=1, microbatches=microbatches
    )
    assert _serve_every_batch(table, plan, seed=11, epochs=4) >= 4


def test_pinned_cap_below_a_sample_names_the_samples():
    table = synthesize("text-heavy", 200, seed=1)
    tok = per_sample_costs(table, SPEC).llm_tokens
    cap = int(np.sort(tok)[-3])  # two samples are longer
    with pytest.raises(PlanError, match=r"2 sample\(s\).*raise max_tokens to at least") as e:
        make_plan(table, SPEC, Cluster(2, 2, 80.0), 16, dp=2, tp=1, pp=1, max_tokens=cap)
    longest = str(table.keys[int(np.argmax(tok))])
    assert longest in str(e.value)


def test_pinned_cap_too_small_for_a_heavy_batch_is_refused_at_plan_time():
    table = synthesize("text-heavy", 200, seed=1)
    tok = per_sample_costs(table, SPEC).llm_tokens
    with pytest.raises(PlanError, match="heavy global batch.*pin more microbatches"):
        make_plan(
            table,
            SPEC,
            Cluster(2, 2, 80.0),
            32,
            dp=2,
            tp=1,
            pp=1,
            microbatches=1,
            max_tokens=int(tok.max()),
        )


def test_cli_plan_max_tokens(tmp_path):
    table = synthesize("text-heavy", 120, seed=2)
    index = write_index(table, tmp_path / "index.parquet")
    base = [sys.executable, "-m", "entrain_data.cli", "plan", str(index), "--encoder",
            "qwen2.5-vl-vision", "--llm", "llama-3.2-1b", "--gpus", "2", "--global-batch", "16",
            "-o", str(tmp_path / "plan.json")]  # fmt: skip
    bad = subprocess.run([*base, "--max-tokens", "10"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "max_tokens 10" in bad.stderr and "Traceback" not in bad.stderr
    ok = subprocess.run([*base, "--max-tokens", "60000"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "token cap    60000" in ok.stdout


SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.mark.shared_data
def test_default_plan_serves_every_batch_of_a_real_caption_table():
    """The parquet_captions table once killed the service mid-epoch (3868 tokens for a cap of
    3328 on 4 GPUs, global batch 32): the derived cap now holds every batch of every epoch."""
    table_path = SHARED / "parquet_captions" / "test_10000.parquet"
    if not table_path.is_file():
        pytest.skip(f"shared test data not found at {table_path}")
    from entrain_data.workers.index_builder import build_index

    table = build_index([str(table_path)], parquet_columns={"text": "TEXT"}, progress=False)
    for gpus, batch in ((4, 32), (2, 16)):
        plan = make_plan(table, SPEC, Cluster(gpus, 8, 80.0), batch)
        assert _serve_every_batch(table, plan, seed=0, epochs=2) > 100


def test_cli_plan_max_delay(tmp_path):
    from entrain_data.plan import ParallelPlan

    table = synthesize("text-heavy", 120, seed=2)
    index = write_index(table, tmp_path / "index.parquet")
    out = tmp_path / "plan.json"
    base = [sys.executable, "-m", "entrain_data.cli", "plan", str(index), "--encoder",
            "qwen2.5-vl-vision", "--llm", "llama-3.2-1b", "--gpus", "2", "--global-batch", "16",
            "-o", str(out)]  # fmt: skip
    ok = subprocess.run([*base, "--max-delay", "2"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ParallelPlan.load(out).max_delay == 2 and "wait up to 2 iteration" in ok.stdout
    bad = subprocess.run([*base, "--max-delay", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "max_delay" in bad.stderr and "Traceback" not in bad.stderr
