"""EntrainLoader.wrap and sample fields the wire cannot carry (only numeric tensors cross it):
refused by name at dataset[0], named and skipped later on, never a worker death; an item
missing a field is skipped whether a Dataset or a DataLoader over it is wrapped."""

from __future__ import annotations

import json

import pytest
import torch

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput, SampleError

pytestmark = pytest.mark.timeout(240)


class Fields(torch.utils.data.Dataset):
    """32 items ``{"x", "y"}``; ``odd`` replaces fields of some items (``{i: {field: value}}``,
    ``None`` as a value drops the field); ``first`` adds fields to every item."""

    def __init__(self, odd: dict | None = None, first: dict | None = None) -> None:
        self.odd, self.first = odd or {}, first or {}

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        item = {"x": torch.full((2,), float(i)), "y": torch.tensor(i), **self.first}
        for name, value in self.odd.get(i, {}).items():
            if value is None:
                item.pop(name)
            else:
                item[name] = value
        return item


def cost(i: int) -> tuple[float, float, int]:
    return (0.0, 1.0, 1)


def stack_xy(batch: list[dict]) -> dict:
    """A user's own collate: it reads both fields by name."""
    return {"x": torch.stack([b["x"] for b in batch]), "y": torch.stack([b["y"] for b in batch])}


def as_text(batch: list[dict]) -> dict:
    return {"x": torch.stack([b["x"] for b in batch]), "text": [str(b["y"]) for b in batch]}


def _loader(ds, collate=None):
    kw = {"collate_fn": collate} if collate else {}
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, drop_last=True, **kw)


def _serve(tmp_path, src, **kw) -> tuple[list[int], list[dict]]:
    """Every key served in one epoch, and the skipped record's lines."""
    record = tmp_path / "skipped.jsonl"
    with EntrainLoader.wrap(
        src, cost, world_size=1, timeout=60, socket_dir=str(tmp_path / "entrain"),
        skipped_path=str(record), **kw,
    ) as loader:  # fmt: skip
        keys = [int(k) for mb in loader for k in mb.llm_keys]
    assert not list(tmp_path.glob("entrain*"))
    lines = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    return keys, lines


def _refused(tmp_path, src, **kw) -> str:
    """The InvalidInput that wrap raised before starting anything (a service it started is
    stopped, and the test fails)."""
    try:
        loader = EntrainLoader.wrap(
            src, cost, world_size=1, timeout=60, socket_dir=str(tmp_path / "entrain"), **kw
        )
    except InvalidInput as exc:
        return str(exc)
    loader.close()
    pytest.fail("EntrainLoader.wrap started a service for a dataset[0] the wire cannot carry")


def test_wrap_refuses_every_field_of_dataset_0_the_wire_cannot_carry(tmp_path):
    """A str field killed each worker three times (WorkerDied blaming the decoder or memory),
    bf16 stopped the service with torch's TypeError, an image or None leaked default_collate's."""
    from PIL import Image

    bad = {"text": "sample 0", "meta": {"a": torch.tensor(1)}, "half": torch.zeros(2).bfloat16()}
    bad["ids"] = torch.zeros(2, dtype=torch.uint16)  # a torch dtype has no numpy kind
    msg = _refused(tmp_path, _loader(Fields(first=bad)))
    assert "field 'ids' is a uint16 tensor: cast it to one the wire carries" in msg
    assert msg.startswith("dataset[0]: ") and "only tensors of bool" in msg
    assert "field 'text' is a str: turn the text into token ids" in msg
    assert "field 'meta' is a dict: give its parts as top-level fields" in msg
    assert "field 'half' is a bfloat16 tensor: return it as float32 (or float16)" in msg
    assert "'x'" not in msg and "'y'" not in msg
    for value, what in ((Image.new("RGB", (4, 4)), "a PIL.Image.Image"), (None, "None")):
        msg = _refused(tmp_path, Fields(first={"pic": value}), batch_size=4)
        assert f"dataset[0]: field 'pic' is {what}: turn it into a tensor" in msg
        assert "PILToTensor" in msg and "or in a collate_fn" in msg
    msg = _refused(tmp_path, _loader(Fields(), as_text))
    assert "collate_fn([dataset[0]]) gives field 'text' is a list of str: turn the text" in msg
    assert not list(tmp_path.iterdir())


def test_wrap_dataloader_skips_an_item_missing_a_field(tmp_path):
    """Wrapping the DataLoader stopped the service (collate_fn failed on dataset[4, 7, 2, 19]:
    KeyError: 'y') where wrapping its Dataset skipped dataset[7], as the README says."""
    keys, lines = _serve(tmp_path, _loader(Fields({7: {"y": None}})), max_skipped="50%")
    assert sorted(keys) == [i for i in range(32) if i != 7]
    assert [x["key"] for x in lines] == ["7"]
    assert "dataset[7]: fields ['x'] differ from dataset[0]'s ['x', 'y']" in lines[0]["reason"]


def test_wrap_skips_later_items_the_wire_cannot_carry_by_name(tmp_path):
    """dataset[0] is fine; a later str or bf16 field is that item's error, not a worker's."""
    odd = {5: {"x": "oops"}, 9: {"x": torch.zeros(2).bfloat16()}, 11: {"x": torch.zeros(3)}}
    keys, lines = _serve(tmp_path, _loader(Fields(odd)), max_skipped="50%")
    assert sorted(keys) == [i for i in range(32) if i not in odd]
    why = {x["key"]: x["reason"] for x in lines}
    assert sorted(why) == ["11", "5", "9"]
    assert "dataset[5]: field 'x' is a str: turn the text into token ids" in why["5"]
    assert "dataset[9]: field 'x' is a bfloat16 tensor: return it as float32" in why["9"]
    shape = "dataset[11]: field 'x' is a float32 tensor of shape (3,), dataset[0]'s of (2,)"
    assert shape in why["11"]


def test_wrap_custom_collate_failing_on_one_item_skips_it_or_names_it(tmp_path):
    """A user's collate_fn that fails on a microbatch: the item it cannot batch with dataset[0]
    is found and skipped (or, on_error="raise", named) instead of the service stopping."""
    keys, lines = _serve(tmp_path, _loader(Fields({7: {"y": None}}), stack_xy), max_skipped=2)
    assert sorted(keys) == [i for i in range(32) if i != 7]
    assert [x["key"] for x in lines] == ["7"]
    assert "dataset[7]: collate_fn fails on it with dataset[0]: KeyError: 'y'" in lines[0]["reason"]
    with pytest.raises(SampleError, match=r"dataset\[7\]: collate_fn fails on it .*KeyError"):
        _serve(tmp_path, _loader(Fields({7: {"y": None}}), stack_xy), on_error="raise")
    assert not list(tmp_path.glob("entrain*"))
