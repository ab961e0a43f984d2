"""EntrainLoader.wrap on a plain torch Dataset: no index, no plan file; DataLoader settings
respected or refused; tuple samples by field names; clear errors instead of hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput
from entrain_data.presets import ModelSpec

pytestmark = pytest.mark.timeout(240)

COCO = Path(__file__).resolve().parents[2] / "shared" / "data" / "coco_mini"
MODEL = ModelSpec.from_names(["qwen2.5-vl-vision"], "llama-3.2-1b")


class CocoImages(torch.utils.data.Dataset):
    """What a user has: the COCO pictures and their first caption, no index anywhere."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rows = [json.loads(x) for x in (root / "captions.jsonl").open()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        r = self.rows[i]
        with Image.open(self.root / r["path"]) as im:
            small = im.convert("RGB").resize((32, 32))
        return {
            "pixels": torch.from_numpy(np.asarray(small).copy()),
            "index": torch.tensor(i),
            "caption_bytes": torch.tensor(len(r["captions"][0].encode())),
        }

    def sizes(self, i: int) -> dict:
        """Cheap: from the metadata file, no decode."""
        r = self.rows[i]
        return {
            "text_tokens": len(r["captions"][0].encode()) + 2,
            "images": [(r["height"], r["width"])],
        }


class Squares(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, as_tuple: bool = False) -> None:
        self.n, self.as_tuple = n, as_tuple

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.full((4,), i, dtype=torch.int64)
        return (x, i % 5 + 1) if self.as_tuple else {"x": x, "n": i % 5 + 1}


def square_cost(i: int):
    return (0.0, float((i % 5 + 1) ** 2), i % 5 + 1)


class Pictures(Squares):
    """Squares with a picture each, of a size that varies from sample to sample."""

    def sizes(self, i: int) -> dict:
        side = 112 + 56 * (i % 7)
        return {"text_tokens": 16 + 8 * (i % 3), "images": [(side, 2 * side)]}


@pytest.fixture
def coco():
    if not COCO.is_dir():
        pytest.skip(f"shared test data not found at {COCO}")
    return CocoImages(COCO)


@pytest.mark.slow
@pytest.mark.shared_data
def test_wrap_coco_images_no_index_no_plan_two_ranks_every_sample_once(tmp_path, coco):
    loaders = []
    try:
        for rank in (0, 1):  # as each DDP rank would: its own wrap, its own service
            dl = torch.utils.data.DataLoader(coco, batch_size=8, shuffle=True, num_workers=1)
            loaders.append(
                EntrainLoader.wrap(
                    dl,
                    sizes_fn=coco.sizes,
                    model=MODEL,
                    world_size=2,
                    rank=rank,
                    timeout=120,
                    socket_dir=str(tmp_path / f"entrain-{rank}"),
                )
            )
        plan = loaders[0].info["plan"]
        plan = json.loads(plan) if isinstance(plan, str) else plan
        assert plan["dp"] == 2 and plan["global_batch"] == 16
        got = {0: [], 1: []}
        for pair in zip(*loaders):
            for rank, mb in enumerate(pair):
                assert [int(i) for i in mb["index"]] == [int(k) for k in mb.llm_keys]
                assert tuple(mb["pixels"].shape[1:]) == (32, 32, 3)
                got[rank].extend(int(k) for k in mb.llm_keys)
        assert sorted(got[0] + got[1]) == list(range(len(coco)))  # every sample exactly once
        assert got[0] and got[1] and not set(got[0]) & set(got[1])
    finally:
        for ld in loaders:
            ld.close()
    assert not list(tmp_path.glob("entrain-*"))


def test_wrap_refuses_what_it_cannot_honour():
    from entrain_data.workers.wrap_dataset import prepare_wrap

    ds = Squares()
    dl = torch.utils.data.DataLoader
    with pytest.raises(InvalidInput, match=r"shuffle=False.*seeded permutation"):
        prepare_wrap(dl(ds, batch_size=4), square_cost, world_size=2)
    sampler = torch.utils.data.SubsetRandomSampler(range(10))
    with pytest.raises(InvalidInput, match="SubsetRandomSampler"):
        prepare_wrap(dl(ds, batch_size=4, sampler=sampler), square_cost, world_size=2)
    with pytest.raises(InvalidInput, match=r"drop_last=False.*24 samples do not fill.*of 10"):
        prepare_wrap(dl(ds, batch_size=5, shuffle=True), square_cost, world_size=2)
    with pytest.raises(InvalidInput, match="cost_fn cannot be pickled"):
        prepare_wrap(dl(ds, batch_size=4, shuffle=True), lambda i: (0, 1, 1), world_size=2)
    with pytest.raises(InvalidInput, match=r"dataset\[0\] is a tuple of 2: name its parts"):
        prepare_wrap(Squares(as_tuple=True), square_cost, batch_size=4, world_size=2)
    with pytest.raises(InvalidInput, match="give batch_size"):
        prepare_wrap(ds, square_cost, world_size=2)
    with pytest.raises(InvalidInput, match="exactly one of sizes_fn or cost_fn"):
        prepare_wrap(ds, batch_size=4, world_size=2)


def test_wrap_plans_for_the_gpus_memory_given():
    """It planned for 80 GB GPUs whatever the job ran on: a 7B model on 16 GB cards passed."""
    from entrain_data.workers.wrap_dataset import prepare_wrap

    from entrain_data.errors import PlanError

    ds = Pictures()
    model = ModelSpec.from_names(["qwen2.5-vl-vision"], "qwen2.5-7b")
    kw = dict(sizes_fn=ds.sizes, model=model, batch_size=4, world_size=2)
    assert prepare_wrap(ds, **kw).plan.dp == 2
    with pytest.raises(PlanError, match="16 GB"):
        prepare_wrap(ds, gpu_memory_gb=16, **kw)
    plan = prepare_wrap(ds, **kw).plan
    with pytest.raises(InvalidInput, match="gpu_memory_gb sizes a plan wrap derives"):
        prepare_wrap(ds, plan=plan, gpu_memory_gb=16, **kw)


def test_wrap_respects_batch_size_drop_last_and_names_tuple_fields():
    from entrain_data.workers.wrap_dataset import prepare_wrap

    dl = torch.utils.data.DataLoader(Squares(26), batch_size=4, shuffle=True, drop_last=True)
    spec = prepare_wrap(dl, square_cost, world_size=3, rank=1, microbatches=2)
    assert (spec.plan.dp, spec.plan.global_batch, spec.plan.microbatches) == (3, 12, 2)
    assert spec.options["ranks"] == (1, 1)
    enc, llm, tok = spec.source.costs()
    assert list(tok[:6]) == [1, 2, 3, 4, 5, 1] and spec.plan.max_tokens >= 5
    tup = prepare_wrap(
        Squares(as_tuple=True), square_cost, batch_size=4, world_size=1, fields=("x", "n")
    )
    packed = tup.source.make_packer()([0, 3], [0, 3])
    assert packed.tensors["n"].tolist() == [1, 4] and packed.tensors["x"].shape == (2, 4)


def test_wrap_with_a_plan_checks_its_batch():
    from entrain_data.workers.wrap_dataset import prepare_wrap
    from test_service import make_plan

    dl = torch.utils.data.DataLoader(Squares(), batch_size=4, shuffle=True)
    with pytest.raises(InvalidInput, match=r"batch_size 4 x dp 2 != the plan's global batch 12"):
        prepare_wrap(dl, square_cost, plan=make_plan(dp=2, microbatches=3, global_batch=12))


@pytest.mark.slow
def test_script_without_main_guard_is_named(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from entrain_data.client import EntrainLoader\n"
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_wrap_dataset import Squares, square_cost\n"
        "dl = torch.utils.data.DataLoader(Squares(), batch_size=4, shuffle=True)\n"
        "with EntrainLoader.wrap(dl, square_cost, world_size=1, timeout=30) as ld:\n"
        "    next(iter(ld))\n"
    )
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert proc.returncode != 0
    assert 'lacks `if __name__ == "__main__":`' in proc.stderr, proc.stderr[-2000:]
    assert list(tmp.glob("entrain-*")) == []


def test_wrap_with_sizes_holds_the_patch_cap_and_lists_the_encoder_calls(tmp_path):
    """Described by ``sizes_fn``, a wrapped dataset is served as an index is: every encoder set
    within the plan's patch cap, every microbatch with the group-wide encoder calls that
    sharded data parallelism needs; from a ``cost_fn`` (no sizes) neither is known."""
    from entrain_data.workers.wrap_dataset import prepare_wrap

    from entrain_data.cost_model import per_sample_costs
    from entrain_data.dataset_profile import table_from_sizes
    from entrain_data.encoder_calls import ENCODER_CALLS_KEY

    ds = Pictures(32)
    spec = prepare_wrap(ds, sizes_fn=ds.sizes, model=MODEL, batch_size=16, world_size=1)
    patches, uses = spec.source.encoder_stats()
    want = per_sample_costs(table_from_sizes(len(ds), ds.sizes), MODEL).encoder_tokens
    assert np.array_equal(patches, want) and uses["vision"].all() and not uses["audio"].any()
    assert spec.plan.max_encoder_patches > 0
    assert prepare_wrap(ds, square_cost, batch_size=16).source.encoder_stats() is None
    with EntrainLoader.wrap(
        ds, sizes_fn=ds.sizes, model=MODEL, batch_size=16, world_size=1, timeout=60,
        socket_dir=str(tmp_path / "entrain"),
    ) as loader:  # fmt: skip
        mbs = list(loader)
    consumer = {(mb.iteration, k): mb.microbatch for mb in mbs for k in mb.llm_keys}
    for mb in mbs:
        calls = mb.meta[ENCODER_CALLS_KEY]["vision"]
        assert {consumer[mb.iteration, k] for k in mb.encoder_keys} <= set(calls)
        rows = [int(k) for k in mb.encoder_keys]
        assert want[rows].sum() <= spec.plan.max_encoder_patches
    assert sorted(int(k) for mb in mbs for k in mb.llm_keys) == list(range(len(ds)))
