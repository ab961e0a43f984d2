"""Workers' shared-memory segments: written once, mapped by ranks, reused once every reader let go.

The pool and the reader are exercised directly (what a slot holds, when it is free, what
is refused), then through a service whose ranks drop each microbatch after use, as training
does: the segments are reused, every byte is what the coordinator route delivers, and a
microbatch a rank still holds is never overwritten.
"""

from __future__ import annotations

import gc
import glob
import os
import signal
import subprocess
import sys
import warnings
from collections import deque

import numpy as np
import pytest
import torch
from test_service import make_plan, make_shards, settled_stats, start

from entrain_data.client import EntrainLoader
from entrain_data.errors import ProtocolError
from entrain_data.shared_batch import (
    HEAD,
    SegmentPool,
    SegmentReader,
    drop_shared_dir,
    make_shared_dir,
    remove_segments,
    remove_shared_dirs,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shm_root(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="entrain-test-shm-", dir="/dev/shm")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _specs(bufs):
    return [[f"t{i}", "uint8", [len(b)], len(b)] for i, b in enumerate(bufs)]


def _read(reader, slot, bufs, who=0):
    views = reader.views({**slot, "reader": who}, _specs(bufs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mapping: no copy
        return [torch.frombuffer(v, dtype=torch.uint8) for v in views]


def _flags(slot, n):
    with open(slot["path"], "rb") as f:
        return list(f.read(n))


def test_a_slot_is_reused_only_after_its_tensors_are_gone(shm_root):
    pool, reader = SegmentPool(shm_root, "w0.0"), SegmentReader(shm_root)
    a = [np.arange(3000, dtype=np.uint8), np.full(70, 5, np.uint8)]
    slot = pool.write(a, [0])
    assert slot["path"].startswith(shm_root) and all(
        o >= HEAD and o % 64 == 0 for o in slot["offsets"]
    )
    got = _read(reader, slot, a)
    assert [t.numpy().tolist() for t in got] == [x.tolist() for x in a]
    assert _flags(slot, 1) == [1]
    b = [np.full(3000, 9, np.uint8)]
    other = pool.write(b, [0])  # the first is held: a second segment
    assert other["path"] != slot["path"]
    assert got[0].numpy().tolist() == a[0].tolist()  # untouched
    view = got[0][10:20]  # a view keeps it too
    del got
    gc.collect()
    assert _flags(slot, 1) == [1]
    del view
    gc.collect()
    assert _flags(slot, 1) == [0]
    again = pool.write([np.full(100, 1, np.uint8)], [0])
    assert again["path"] == slot["path"] and len(pool.segments) == 2
    pool.close()
    assert os.listdir(shm_root) == []


def test_a_slot_for_several_readers_is_free_when_all_let_go(shm_root):
    pool, r0, r1 = SegmentPool(shm_root, "w0.0"), SegmentReader(shm_root), SegmentReader(shm_root)
    bufs = [np.arange(256, dtype=np.uint8)]
    slot = pool.write(bufs, [0, 1])
    t0, t1 = _read(r0, slot, bufs, 0), _read(r1, slot, bufs, 1)
    assert t0[0].equal(t1[0])
    del t0
    gc.collect()
    assert _flags(slot, 2) == [0, 1]
    assert pool.write(bufs, [0])["path"] != slot["path"]
    del t1
    gc.collect()
    assert _flags(slot, 2) == [0, 0]
    pool.close()


def test_a_duplicate_is_freed_unread_and_an_unsent_claim_given_back(shm_root):
    pool, reader = SegmentPool(shm_root, "w0.0"), SegmentReader(shm_root)
    slot = pool.write([np.zeros(10, np.uint8)], [0, 1])
    reader.release({**slot, "reader": 1})
    pool.release(slot, 0)
    assert _flags(slot, 2) == [0, 0]
    pool.close()


def test_a_full_pool_says_so_and_the_bytes_go_by_socket(shm_root):
    pool = SegmentPool(shm_root, "w0.0", budget=HEAD + (1 << 20))
    held = pool.write([np.zeros(1000, np.uint8)], [0])
    assert held is not None
    assert pool.write([np.zeros(1000, np.uint8)], [0]) is None  # held, and no room for another
    assert pool.write([np.zeros(2 << 20, np.uint8)], [0]) is None  # larger than the budget
    pool.close()


def test_the_reader_refuses_what_is_not_a_slot_of_its_service(shm_root, tmp_path):
    pool, reader = SegmentPool(shm_root, "w0.0"), SegmentReader(shm_root)
    bufs = [np.zeros(64, np.uint8)]
    slot = pool.write(bufs, [0])
    outside = tmp_path / "x.seg"
    outside.write_bytes(bytes(2 * HEAD))
    cases = [
        ({"path": str(outside), "offsets": [HEAD], "reader": 0}, "outside"),
        ({**slot, "reader": -1}, "malformed"),
        ({**slot, "reader": 0, "offsets": [0]}, "bad offset"),
        ({**slot, "reader": 0, "offsets": [1 << 30]}, "tensor ends at"),
        ({**slot, "reader": 0, "offsets": []}, "offsets"),
    ]
    for shm, why in cases:
        with pytest.raises(ProtocolError, match=why):
            reader.views(shm, _specs(bufs))
    assert _flags(slot, 1) == [0]  # refused: its claim is given back
    with pytest.raises(ProtocolError, match="no shared directory"):
        SegmentReader(None).views({**slot, "reader": 0}, _specs(bufs))
    pool.close()


def test_remove_segments_takes_only_that_workers(shm_root):
    a, b = SegmentPool(shm_root, "w0.0"), SegmentPool(shm_root, "w0.1")
    a.write([np.zeros(8, np.uint8)], [0])
    b.write([np.zeros(8, np.uint8)], [0])
    remove_segments(shm_root, "w0.0")
    assert [p.split("/")[-1] for p in os.listdir(shm_root)] == ["w0.1-0.seg"]
    a.close()
    b.close()


def test_a_header_whose_segment_went_with_its_worker_reads_as_lost(shm_root):
    pool, reader = SegmentPool(shm_root, "w0.0"), SegmentReader(shm_root)
    bufs = [np.arange(HEAD, dtype=np.uint8)]
    slot = pool.write(bufs, [0])
    remove_segments(shm_root, "w0.0")  # the coordinator, once the worker died
    shm = {**slot, "reader": 0}
    assert reader.views(shm, _specs(bufs)) is None  # lost: the rank asks for it again
    reader.release(shm)  # nothing left to free, and no error
    pool.close()


def _consume(endpoint, keep, direct=True):
    """Two ranks in lockstep, each holding only its last ``keep`` microbatches (as training
    does); a held one is checked unchanged when it is let go. Returns {rank: [(pos, keys,
    tensors cloned)]}, the service's shared directory, how many segments it held and the
    service's stats once every worker has reported."""
    loaders = [EntrainLoader(endpoint, r, prefetch=2, timeout=30, direct=direct) for r in (0, 1)]
    try:
        its = [iter(ld) for ld in loaders]
        seen = {0: [], 1: []}
        held = {0: deque(), 1: deque()}
        live = [True, True]
        while any(live):
            for r, it in enumerate(its):
                if not live[r]:
                    continue
                mb = next(it, None)
                if mb is None:
                    live[r] = False
                    continue
                copy = {k: t.clone() for k, t in mb.tensors.items()}
                seen[r].append(((mb.epoch, mb.iteration, mb.microbatch), mb.llm_keys, copy))
                held[r].append((mb, copy))
                if len(held[r]) > keep:
                    old, snap = held[r].popleft()
                    assert all(old[k].equal(v) for k, v in snap.items())
        shm = loaders[0].info.get("shm_dir")
        segments = len([f for f in os.listdir(shm) if f.endswith(".seg")]) if shm else 0
        samples = sum(len(keys) for v in seen.values() for _, keys, _ in v)
        return seen, shm, segments, settled_stats(loaders[0], samples)
    finally:
        for ld in loaders:
            ld.close()


@pytest.mark.slow  # 15-26 s on 2 cores (the default run stays near 10 minutes)
def test_segments_are_reused_and_carry_what_the_coordinator_route_does(tmp_path):
    index = make_shards(tmp_path, shards=4, per_shard=48)  # 192 samples, 48 microbatches a rank
    plan = make_plan()
    svc = start(tmp_path, index, plan, seed=3)
    try:
        got, shm, segments, _ = _consume(svc.endpoint, keep=2)
        assert svc.wait(15) == 0
    finally:
        svc.close()
    assert shm is not None and not os.path.exists(shm)
    delivered = sum(len(v) for v in got.values())
    assert delivered == 96
    assert segments <= delivered // 3  # each segment served several microbatches
    svc = start(tmp_path, index, plan, seed=3)
    try:
        ref, *_ = _consume(svc.endpoint, keep=0, direct=False)
    finally:
        svc.close()
    for r in (0, 1):
        assert [(p, k) for p, k, _ in got[r]] == [(p, k) for p, k, _ in ref[r]]
        for (_, _, a), (_, _, b) in zip(got[r], ref[r]):
            assert a.keys() == b.keys() and all(a[n].equal(b[n]) for n in a)


def test_a_free_segment_goes_back_to_the_ranks_that_have_it_mapped(shm_root):
    pool, reader = SegmentPool(shm_root, "w0.0"), SegmentReader(shm_root)
    bufs = [np.zeros(100, np.uint8)]
    held = {to: (pool.write(bufs, [to]), None) for to in ("a", "b")}
    held = {to: (slot, _read(reader, slot, bufs)) for to, (slot, _) in held.items()}
    paths = {to: slot["path"] for to, (slot, _) in held.items()}
    del held
    gc.collect()
    assert pool.write(bufs, ["b"])["path"] == paths["b"]
    assert pool.write(bufs, ["a"])["path"] == paths["a"]
    pool.close()


def test_a_rank_that_cannot_see_the_services_shared_memory_is_sent_the_bytes(tmp_path, monkeypatch):
    import entrain_data.connection as connection

    real = os.access
    blind = lambda path, mode: False if "entrain-shm-" in str(path) else real(path, mode)  # noqa: E731
    monkeypatch.setattr(connection.os, "access", blind)  # as if in another container
    index = make_shards(tmp_path)
    svc = start(tmp_path, index, make_plan(), seed=3)
    try:
        got, _, _, stats = _consume(svc.endpoint, keep=1)
    finally:
        svc.close()
    assert sum(len(v) for v in got.values()) == 24
    assert stats["bytes_served"] > 0 and stats["bytes_shared_memory"] == 0


def test_a_rank_may_write_into_its_tensors_without_touching_peers_or_later_microbatches(shm_root):
    pool, r0, r1 = SegmentPool(shm_root, "w0.0"), SegmentReader(shm_root), SegmentReader(shm_root)
    bufs = [np.full(3 * HEAD, 7, np.uint8)]
    slot = pool.write(bufs, [0, 1])
    mine, theirs = _read(r0, slot, bufs, 0)[0], _read(r1, slot, bufs, 1)[0]
    mine[:] = 1  # in place, as a training loop may (e.g. masking labels)
    assert int(theirs.sum()) == 7 * 3 * HEAD and int(mine.sum()) == 3 * HEAD
    del mine, theirs
    gc.collect()
    again = pool.write([np.full(3 * HEAD, 9, np.uint8)], [0])
    assert again["path"] == slot["path"]
    assert _read(r0, again, bufs)[0].tolist() == [9] * (3 * HEAD)
    pool.close()


def _owner(root, wait: bool) -> subprocess.Popen:
    """Another process that makes a shared directory under ``root``, prints it, and holds it
    until its stdin closes (``wait``) or ends at once."""
    code = (
        "import sys; from entrain_data.shared_batch import make_shared_dir; "
        f"print(make_shared_dir(root={str(root)!r}), flush=True); "
        + ("sys.stdin.read()" if wait else "")
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_a_dead_services_shared_directory_is_removed_by_the_next_one(tmp_path):
    dead = _owner(tmp_path, wait=False)
    gone = dead.stdout.readline().strip()
    dead.wait(30)  # ended: as a coordinator killed with SIGKILL, its lock is gone
    live = _owner(tmp_path, wait=True)
    try:
        held = live.stdout.readline().strip()
        assert os.path.basename(held).startswith(f"entrain-shm-{live.pid}-")
        mine = make_shared_dir(root=str(tmp_path))  # the next service on this host sweeps
        assert not os.path.exists(gone)
        assert os.path.isdir(held) and os.path.isdir(mine)  # live owners keep theirs
        assert remove_shared_dirs(root=str(tmp_path)) == []
    finally:
        live.stdin.close()
        live.wait(30)
    assert remove_shared_dirs(pid=live.pid, root=str(tmp_path)) == [held]
    drop_shared_dir(mine)
    assert os.listdir(tmp_path) == []


def test_a_service_killed_with_sigkill_leaves_no_shared_directory_after_close(tmp_path):
    index = make_shards(tmp_path, per_shard=12)
    svc = start(tmp_path, index, make_plan())
    try:
        loader = EntrainLoader(svc.endpoint, 0, prefetch=1, timeout=30)
        next(iter(loader))  # a direct rank on this host: the service made its directory
        assert glob.glob(f"/dev/shm/entrain-shm-{svc.pid}-*")
        os.kill(svc.pid, signal.SIGKILL)
        svc.process.join(5)
        loader.close()
    finally:
        svc.close()
    assert not glob.glob(f"/dev/shm/entrain-shm-{svc.pid}-*")
