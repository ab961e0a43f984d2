"""The loader service end to end: exactly once, determinism, shutdown, observability.

The dataset is a WebDataset built by the test (tar shards of ``.txt`` members);
the packer used here reads the real tar members and packs their bytes as token
ids, so the service machinery (schedule, workers, routing, credits) is tested
independently of the image/audio decoders.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from entrain_data.workers.sample_source import CustomSource, Packed
from entrain_data.workers.service import start_service

from entrain_data.client import EntrainLoader
from entrain_data.errors import SampleError
from entrain_data.metadata import SampleMeta, SampleTable, read_index, write_index
from entrain_data.plan import ParallelPlan, StagePlan, StageSegment

pytestmark = pytest.mark.timeout(120)


def make_shards(root: Path, shards: int = 2, per_shard: int = 24, bad: dict | None = None) -> Path:
    """Write tar shards of text samples and their index; ``bad`` maps key -> 'missing'."""
    bad = bad or {}
    records = []
    for s in range(shards):
        path = root / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                key = f"s{s}-{i:04d}"
                text = (f"sample {key} " * (1 + (i * 7) % 13)).encode()
                if bad.get(key) != "missing":
                    info = tarfile.TarInfo(f"{key}.txt")
                    info.size = len(text)
                    tar.addfile(info, io.BytesIO(text))
                records.append(
                    SampleMeta(key=key, source=str(path), member=key, text_tokens=len(text))
                )
    index = root / "index.parquet"
    write_index(SampleTable.from_records(records), index)
    return index


def make_plan(dp: int = 2, microbatches: int = 3, global_batch: int = 12) -> ParallelPlan:
    seg = StageSegment("llm", None, 0, 2, True, True)
    return ParallelPlan(
        world_size=dp,
        gpus_per_node=8,
        dp=dp,
        tp=1,
        pp=1,
        stages=(StagePlan(0, (seg,)),),
        microbatches=microbatches,
        global_batch=global_batch,
        max_tokens=1 << 20,
        defer_budget=1 << 20,
        method="entrain",
    )


def make_index_plan(**kw) -> ParallelPlan:
    """:func:`make_plan` with an LLM-only model: what serving an index (priced by it) needs."""
    from entrain_data.presets import ModelSpec

    llm = ModelSpec.from_names([], "llama-3.2-1b")
    return ParallelPlan.from_dict({**make_plan(**kw).to_dict(), "model": llm.to_dict()})


@dataclass(frozen=True)
class TextCosts:
    """Costs from the index alone: LLM cost quadratic in text length, no encoder."""

    index_path: str

    def __call__(self):
        t = read_index(self.index_path).text_tokens.astype(np.float64)
        return np.zeros((len(t), 1)), t + t**2 / 512.0, t.astype(np.int64)


@dataclass(frozen=True)
class IndexKeys:
    """The sample keys of the index (what the service names in its skip record)."""

    index_path: str

    def __call__(self):
        return [str(k) for k in read_index(self.index_path).keys]


@dataclass(frozen=True)
class TarTextPacker:
    """Reads ``<member>.txt`` from the shard, packs bytes as token ids (padding-free)."""

    index_path: str
    on_error: str = "raise"
    die_on_task: int = -1  # worker exits hard on its n-th task (fault tests) ...
    die_marker: str = ""  # ... once: the first to die leaves this file
    die_on_key: str = ""  # every worker that packs this sample exits hard (a poison sample)

    def __call__(self):
        return _TarTextPack(self)


class _TarTextPack:
    def __init__(self, spec: TarTextPacker) -> None:
        self.spec = spec
        self.table = read_index(spec.index_path)
        self.count = 0

    def _read(self, row: int) -> bytes:
        src, member = str(self.table.sources[row]), str(self.table.members[row])
        try:
            with tarfile.open(src) as tar:
                return tar.extractfile(f"{member}.txt").read()
        except (KeyError, OSError, tarfile.TarError) as exc:
            raise SampleError(
                f"{src}: sample {member!r}: {exc}", source=src, key=str(self.table.keys[row])
            ) from exc

    def __call__(self, encoder_rows, llm_rows) -> Packed:
        self.count += 1
        if self.count == self.spec.die_on_task and not os.path.exists(self.spec.die_marker):
            Path(self.spec.die_marker).touch()
            os._exit(9)
        if self.spec.die_on_key in {str(self.table.keys[r]) for r in llm_rows}:
            os._exit(11)  # as a decoder's segfault would
        skipped, texts = [], []
        for r in llm_rows:
            try:
                texts.append((r, self._read(r)))
            except SampleError as exc:
                if self.spec.on_error == "raise":
                    raise
                skipped.append({"key": exc.key, "source": exc.source, "error": str(exc)})
        bad = {s["key"] for s in skipped}
        enc_keys = [str(self.table.keys[r]) for r in encoder_rows]
        enc_keys = [k for k in enc_keys if k not in bad]
        ids = [np.frombuffer(t, dtype=np.uint8).astype(np.int64) for _, t in texts]
        lens = np.array([len(x) for x in ids], dtype=np.int64)
        cu = np.zeros(len(ids) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(lens)
        input_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        pos = np.concatenate([np.arange(n) for n in lens]) if ids else np.zeros(0, np.int64)
        return Packed(
            encoder_keys=enc_keys,
            llm_keys=[str(self.table.keys[r]) for r, _ in texts],
            tensors={"input_ids": input_ids, "position_ids": pos, "cu_seqlens": cu},
            skipped=skipped,
        )


def start(tmp_path: Path, index: Path, plan: ParallelPlan, **kw):
    kw.setdefault("workers", 2)
    on_error = kw.pop("on_error", "raise")
    die = kw.pop("die_on_task", -1)
    marker = kw.pop("die_marker", str(tmp_path / "died"))
    poison = kw.pop("die_on_key", "")
    source = CustomSource(
        TarTextPacker(str(index), on_error, die, marker, poison),
        TextCosts(str(index)),
        IndexKeys(str(index)),
    )
    return start_service(
        plan=plan,
        source=source,
        socket_dir=str(tmp_path / "entrain-sock"),
        **kw,
    )


@pytest.fixture
def dataset(tmp_path):
    return make_shards(tmp_path)


def run_ranks(endpoint: str, ranks, limit: int | None = None, timeout: float = 30.0):
    """Iterate every rank's epoch in lockstep (as training does); returns {rank: [Microbatch]}."""
    loaders = [EntrainLoader(endpoint, r, prefetch=2, timeout=timeout) for r in ranks]
    try:
        its = [iter(ld) for ld in loaders]
        out = {r: [] for r in ranks}
        done = set()
        while len(done) < len(ranks) and (
            limit is None or all(len(v) < limit for v in out.values())
        ):
            for r, it in zip(ranks, its):
                if r in done:
                    continue
                try:
                    out[r].append(next(it))
                except StopIteration:
                    done.add(r)
        return out, loaders
    except BaseException:
        for ld in loaders:
            ld.close()
        raise


def close_all(loaders):
    for ld in loaders:
        ld.close()


def settled_stats(loader, samples: int, wait: float = 10.0) -> dict:
    """The service's stats once every worker's report of ``samples`` delivered samples is in.

    On the direct route a rank can hold its last microbatch before the worker that sent it
    has reported to the coordinator, so the counters settle a moment after the data arrives.
    """
    deadline = time.monotonic() + wait
    while True:
        stats = loader.stats()
        if stats["samples_served"] >= samples or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def assert_exactly_once(out, keys):
    enc = [k for mbs in out.values() for mb in mbs for k in mb.encoder_keys]
    llm = [k for mbs in out.values() for mb in mbs for k in mb.llm_keys]
    assert sorted(enc) == sorted(keys)
    assert sorted(llm) == sorted(keys)


def test_exactly_once_two_ranks_and_clean_shutdown(tmp_path, dataset):
    plan = make_plan()
    keys = list(read_index(dataset).keys)
    svc = start(tmp_path, dataset, plan)
    try:
        out, loaders = run_ranks(svc.endpoint, [0, 1])
        assert_exactly_once(out, keys)
        for r, mbs in out.items():
            assert all(mb.replica == r for mb in mbs)
            pos = [(mb.iteration, mb.microbatch) for mb in mbs]
            assert pos == sorted(pos) and len(pos) == 4 * 3
            for mb in mbs:
                # zero copy: a view of the received zmq frame, not a torch-owned allocation
                assert not mb["input_ids"].untyped_storage().resizable()
                cu = mb["cu_seqlens"]
                assert int(cu[-1]) == mb.num_tokens and len(cu) == len(mb.llm_keys) + 1
        stats = settled_stats(loaders[0], len(keys))
        assert stats["samples_served"] == len(keys)
        assert stats["microbatches_served"] == 2 * 12 and stats["bytes_served"] > 0
        assert stats["assignment_latency_s"]["count"] >= 4
        assert len(stats["workers"]) == 2
        close_all(loaders)
        assert svc.wait(15) == 0  # every rank got every epoch: the service ends by itself
    finally:
        svc.close()
    assert not svc.alive()
    assert not (tmp_path / "entrain-sock").exists()


@pytest.mark.slow
def test_same_seed_same_sequence_other_seed_differs(tmp_path, dataset):
    plan = make_plan()

    def sequence(seed):
        svc = start(tmp_path, dataset, plan, seed=seed)
        try:
            out, loaders = run_ranks(svc.endpoint, [0, 1])
            close_all(loaders)
            return {r: [(mb.encoder_keys, mb.llm_keys) for mb in v] for r, v in out.items()}
        finally:
            svc.close()

    a, b, c = sequence(3), sequence(3), sequence(4)
    assert a == b
    assert a != c


@pytest.mark.slow
def test_zero_copy_tensors_view_received_frames(tmp_path, dataset):
    svc = start(tmp_path, dataset, make_plan(), workers=1)
    try:
        with EntrainLoader(svc.endpoint, 0, timeout=30) as ld:
            mb = next(iter(ld))
            t = mb["input_ids"]
            assert t.dtype.is_floating_point is False and t.numel() == mb.num_tokens
            # a view of the zmq frame: its storage is not owned by torch's allocator
            assert not t.untyped_storage().resizable()
    finally:
        svc.close()


def test_sample_error_raise_names_shard_and_key(tmp_path):
    index = make_shards(tmp_path, bad={"s0-0003": "missing"})
    svc = start(tmp_path, index, make_plan())
    try:
        with pytest.raises(SampleError, match="s0-0003") as info:  # typed across the wire
            out, loaders = run_ranks(svc.endpoint, [0, 1], timeout=20)
        assert "shard-000.tar" in str(info.value)
        assert info.value.key == "s0-0003" and info.value.source.endswith("shard-000.tar")
        assert svc.wait(15) != 0
    finally:
        svc.close()


@pytest.mark.slow
def test_sample_error_skip_counts_and_writes_keys(tmp_path):
    index = make_shards(tmp_path, bad={"s0-0003": "missing", "s1-0010": "missing"})
    skipped = tmp_path / "skipped.jsonl"
    svc = start(
        tmp_path, index, make_plan(), on_error="skip", skipped_path=str(skipped), max_skipped=2
    )
    try:
        out, loaders = run_ranks(svc.endpoint, [0, 1])
        keys = [k for k in read_index(index).keys if k not in ("s0-0003", "s1-0010")]
        assert_exactly_once(out, keys)
        assert settled_stats(loaders[0], len(keys))["skipped_samples"] == 2
        close_all(loaders)
    finally:
        svc.close()
    text = skipped.read_text()
    assert "s0-0003" in text and "s1-0010" in text


@pytest.mark.parametrize("sig", [pytest.param("SIGINT", marks=pytest.mark.slow), "SIGTERM"])
def test_signal_stops_service_and_workers_without_leftovers(tmp_path, dataset, sig):
    import signal

    import psutil  # noqa: F401  # optional; skip below if missing

    svc = start(tmp_path, dataset, make_plan())
    try:
        ld = EntrainLoader(svc.endpoint, 0, timeout=30)
        next(iter(ld))
        children = psutil.Process(svc.pid).children(recursive=True)
        assert len(children) >= 2
        os.kill(svc.pid, getattr(signal, sig))
        svc.process.join(10)
        assert not svc.alive() and svc.process.exitcode == 0
        deadline = time.monotonic() + 5
        while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
            assert time.monotonic() < deadline, "worker processes left behind"
            time.sleep(0.1)
        assert not (tmp_path / "entrain-sock").exists()
        ld.close()
    finally:
        svc.close()
