"""A plan made from an index serves every global batch of that index, or says at plan time why not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from entrain_data.workers.schedule import epoch_batches
from hypothesis import given, settings
from hypothesis import strategies as st

from entrain_data.assignment import assign
from entrain_data.cost_model import per_sample_costs
from entrain_data.errors import PlanError
from entrain_data.metadata import write_index
from entrain_data.plan import Cluster
from entrain_data.planner import make_plan
from entrain_data.presets import ModelSpec
from entrain_data.token_caps import _shuffled_batches, count_floor, heavy_batches
from entrain_data.workloads import synthesize

SPEC = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")


def _serve_every_batch(table, plan, seed: int, epochs: int, spec: ModelSpec = SPEC) -> int:
    """Assign every global batch the service would cut in ``epochs`` epochs; returns how many."""
    costs = per_sample_costs(table, spec)
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
    # 192 GB GPUs: these few-microbatch layouts carry up to ~80k LLM tokens per microbatch,
    # whose LM-head logits and fp32 loss tensors outgrow an 80 GB GPU (the memory model counts
    # them); the test is about the token caps serving every batch, not about memory
    plan = make_plan(
        table, SPEC, Cluster(2, 2, 192.0), batch, dp=2, tp=1, pp=1, microbatches=microbatches
    )
    assert _serve_every_batch(table, plan, seed=11, epochs=4) >= 4


def test_plan_serves_documents_whose_images_crowd_the_patch_cap():
    """Images capped at 1280 tokens sit at ~4900 patches each, a quarter of a text-heavy table
    holds one, and a set holds four samples: the token cap's rule (1.5x a mean set) gave 9517
    patches, so more images than sets each took more than half a set and batches of the index
    could not be served (replica 1: cannot pack 256 samples into 64 microbatches). The counting
    floor raises the cap until they fit."""
    spec = ModelSpec.from_names(["qwen2.5-vl-vision-1280"], "llama-3.2-1b")
    table = synthesize("text-heavy", 8192, seed=4)
    plan = make_plan(table, spec, Cluster(4, 4, 80.0), 1024, dp=4, tp=1, pp=1, microbatches=64)
    assert _serve_every_batch(table, plan, seed=11, epochs=2, spec=spec) == 16


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    sets=st.integers(1, 64),
    per=st.integers(1, 8),
    heavy=st.floats(0.0, 1.0),
)
def test_count_floor_leaves_an_eighth_of_the_room(seed, sets, per, heavy):
    """At a cap at the floor (and above the largest sample), at most j samples per set are
    larger than cap / (j + 1) on 7/8 of the sets: whatever the sizes, no batch is refused by
    counting."""
    rng = np.random.default_rng(seed)
    n = sets * per
    sizes = np.where(rng.random(n) < heavy, rng.integers(4800, 5100, n), rng.integers(0, 900, n))
    cap = max(count_floor(-np.sort(-sizes), sets), int(sizes.max()))
    room = max(1, int(sets * 7 / 8))
    for j in range(1, per + 1):
        assert (sizes > cap / (j + 1)).sum() <= j * room


def test_heavy_batches_give_the_heaviest_total_and_the_elementwise_largest_sorted_batch():
    """Position k holds the largest k-th largest size over the shuffled batches (the floor
    must hold for the heaviest of them, not for a typical one)."""
    sizes = np.random.default_rng(0).integers(0, 1000, 900)
    heavy, got = heavy_batches(sizes, 100, seed=3)
    batches = np.concatenate(list(_shuffled_batches(900, 100, 3, 8)))
    assert heavy == sizes[batches].sum(axis=1).max()
    assert np.array_equal(got, np.sort(sizes[batches], axis=1)[:, ::-1].max(axis=0))
    assert got[0] == sizes.max() and (np.diff(got) <= 0).all()


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


def test_pinned_cap_refusal_says_which_microbatches_it_tried():
    """The refusal said "no layout with more microbatches fits either" when the user had pinned
    them (none was tried), and blamed the cap when memory was what ruled the layouts out."""
    table = synthesize("text-heavy", 200, seed=1)
    tok = per_sample_costs(table, SPEC).llm_tokens
    kw = dict(dp=2, tp=1, pp=1, max_tokens=int(tok.max()))
    with pytest.raises(PlanError, match="pinned microbatches=1; raise max_tokens to at least"):
        make_plan(table, SPEC, Cluster(2, 2, 80.0), 32, microbatches=1, **kw)
    with pytest.raises(PlanError, match=r"even at the most microbatches searched \(dp=2, micro"):
        make_plan(table, SPEC, Cluster(2, 2, 80.0), 4, **kw)
    # a cap that serves the batch on a GPU too small for the model: memory is the reason
    with pytest.raises(PlanError, match="GB per GPU") as err:
        make_plan(table, SPEC, Cluster(2, 2, 4.0), 32, microbatches=8, **kw)
    assert "max_tokens" not in str(err.value)


def test_cli_plan_max_tokens(tmp_path):
    table = synthesize("text-heavy", 120, seed=2)
    index = write_index(table, tmp_path / "index.parquet")
    base = [sys.executable, "-m", "entrain_data.cli", "plan", str(index), "--encoder",
            "qwen2.5-vl-vision", "--llm", "llama-3.2-1b", "--gpus", "2", "--global-batch", "16",
            "-o", str(tmp_path / "plan.json")]  # fmt: skip
    bad = subprocess.run([*base, "--max-tokens", "10"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--max-tokens 10" in bad.stderr and "Traceback" not in bad.stderr
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
    assert bad.returncode == 2 and "--max-delay" in bad.stderr and "Traceback" not in bad.stderr
