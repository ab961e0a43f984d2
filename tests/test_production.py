"""The coordinator's routing bookkeeping (workers/production.py), as pure logic: which ranks a
task names, what the worker returns, and how a rank's report of what it holds repairs losses."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from entrain_data.workers.delivery import without_unread
from entrain_data.workers.production import Production, RankState

from entrain_data import protocol
from entrain_data.errors import ProtocolError


def _pos(epoch: int, it: int, mb: int) -> int:
    return (epoch * 4 + it) * 3 + mb  # 4 iterations of 3 microbatches


def _direct(rank: int, replica: int = 0, next_pos: int = 0, remote: bool = False) -> RankState:
    r = RankState(bytes([rank]), rank, replica, next_pos, data=f"ipc:///tmp/r{rank}", ahead=2)
    if remote:
        r.remote = (f"tcp://127.0.0.1:{5000 + rank}", "k" * 40)
    return r


def test_peers_a_step_apart_share_one_task_and_a_lone_rank_stays_in_its_prefetch():
    prod = Production(window=4, end_pos=24)
    lead, peer = _direct(0, next_pos=3), _direct(1, next_pos=2)
    prod.plan([lead, peer])
    assert list(prod.queue) == [(0, 2), (0, 3), (0, 4)]
    flight = prod.take([lead, peer], (0, 4), remote=False)
    assert flight is not None and sorted(r for r, _ in flight.dests) == [0, 1]
    assert not flight.payload  # nobody is served by hop: the coordinator wants no bytes
    alone = _direct(2, next_pos=0)
    prod = Production(window=4, end_pos=24)
    prod.plan([alone])
    assert list(prod.queue) == [(0, 0), (0, 1)]  # prefetch 2, not the window of 4


def test_a_remote_worker_reaches_ranks_with_a_tcp_socket_and_returns_the_rest():
    prod = Production(window=4, end_pos=24)
    with_tcp, without = _direct(0, remote=True), _direct(1)
    flight = prod.take([with_tcp], (0, 0), remote=True)
    assert flight.remote and [r for r, _ in flight.dests] == [0] and not flight.payload
    route = prod.route(flight, {0: with_tcp})
    assert route["deliver"] == [[0, with_tcp.remote[0], [], "k" * 40]] and route["shared"] is None
    flight = prod.take([without], (0, 0), remote=True)
    assert flight.dests == [] and flight.payload  # the coordinator forwards it


def test_a_rank_report_of_what_it_holds_resends_the_lost_and_drops_an_unreachable_tcp_route():
    r = _direct(0, remote=True)
    prod = Production(window=4, end_pos=24)
    by_rank = {0: r}
    for tid, pos in enumerate((0, 1)):
        flight = prod.take([r], (0, pos), remote=True)
        prod.launched(tid, flight, by_rank)
        prod.landed(tid, by_rank, {0}, None)
    assert r.sent == {0, 1} and r.sent_remote == {0, 1}
    report = {"n": 0, "next": [0, 0, 0], "have": [[0, 0, 1]]}
    r.credit(report, lambda e, i, m: _pos(e, i, m), 24)
    assert r.sent == {0, 1} and r.remote is not None  # once missing: may be in the pipe
    r.credit(report, lambda e, i, m: _pos(e, i, m), 24)
    assert r.sent == {1}  # missing twice: position 0 never arrived, it is needed again ...
    assert r.remote is None  # ... and remote workers' microbatches for it now go by hop
    prod.plan([r])
    assert (0, 0) in prod.queue


def test_a_microbatch_in_the_pipe_at_one_report_is_not_sent_twice():
    """A worker reports its send once the bytes are queued: a rank's report written a moment
    before they arrive misses them. Held by the next report, it is not sent again (it was,
    and counted twice: samples_served 49 of 48 in one CI run)."""
    r = _direct(0)
    prod = Production(window=4, end_pos=24)
    flight = prod.take([r], (0, 0), remote=False)
    prod.launched(0, flight, {0: r})
    prod.landed(0, {0: r}, {0}, None)
    pos = lambda e, i, m: _pos(e, i, m)  # noqa: E731
    r.credit({"n": 0, "next": [0, 0, 0], "have": []}, pos, 24)  # crossed it
    assert r.sent == {0} and r.unheld == {0}
    r.credit({"n": 0, "next": [0, 0, 0], "have": [[0, 0, 0]]}, pos, 24)  # arrived
    assert r.sent == {0} and r.unheld == set()
    prod.plan([r])
    assert (0, 0) not in prod.queue


def test_a_lost_worker_puts_its_microbatch_back_and_malformed_credits_are_refused():
    r = _direct(0)
    prod = Production(window=4, end_pos=24)
    flight = prod.take([r], (0, 0), remote=False)
    prod.launched(7, flight, {0: r})
    assert r.flying == {0}
    prod.lost([7], {0: r})
    assert r.flying == set() and prod.queue[0] == (0, 0)
    for bad in ({"n": -1}, {"n": 1, "next": ["x"]}, {"n": 1, "tcp": {"endpoint": "ipc://x"}}):
        with pytest.raises(ProtocolError):
            r.credit(bad, lambda e, i, m: _pos(e, i, m), 24)


def _payload() -> list[zmq.Frame]:
    """A ``batch`` message as the coordinator holds one: zmq frames, pixels and mel frames."""
    tensors = {
        "input_ids": np.arange(6, dtype=np.int64),
        "pixel_values": np.full((4, 12), 7, dtype=np.uint8),
        "image_sample": np.zeros(4, dtype=np.int64),
        "audio_features": np.ones((2, 8), dtype=np.float32),
    }
    fields = {"epoch": 0, "iteration": 0, "microbatch": 0, "llm_keys": ["a", "b"]}
    return [zmq.Frame(bytes(f)) for f in protocol.encode("batch", fields, tensors)]


def test_a_relayed_message_loses_the_frames_its_rank_never_reads_and_keeps_the_rest_as_is():
    frames = _payload()
    assert without_unread(frames, ()) is frames
    assert without_unread(frames, ("pixel_values_videos",)) is frames  # nothing of it here
    kept = without_unread(frames, ("audio_features", "pixel_values"))
    msg = protocol.decode(kept)
    assert [s.name for s in msg.specs] == ["input_ids", "image_sample"]
    assert kept[1] is frames[1] and kept[2] is frames[3]  # the same frames: no byte copied
    assert msg.header["llm_keys"] == ["a", "b"] and msg.arrays()["input_ids"].tolist() == [
        *range(6)
    ]


def test_hop_ranks_and_direct_ranks_fed_from_a_payload_get_only_what_their_stage_reads():
    """The relay applies the direct route's rule: a hop rank on an LLM-only stage, and a direct
    rank whose microbatch a remote worker brought back, are not sent the pixels."""
    unread = ("audio_features", "pixel_values", "pixel_values_videos")
    prod = Production(window=4, end_pos=24)
    encoder = RankState(b"e", 0, 0, 0, credits=2)
    llm = [RankState(bytes([r]), r, 0, 0, credits=2, unread=unread) for r in (1, 2)]
    fed = _direct(3)
    fed.unread = unread
    prod.ready[(0, 0)] = (_payload(), 2)
    assert [len(f) for _, f, _ in prod.deliverable(encoder)] == [5]  # all of it
    (pos, a, n), (_, b, _) = prod.deliverable(llm[0]) + prod.deliverable(llm[1])
    assert pos == 0 and n == 2 and a is b  # built once for both LLM-only peers
    assert [s.name for s in protocol.decode(a).specs] == ["input_ids", "image_sample"]
    (_, c, _) = prod.deliverable(fed)[0]
    assert c is a
    prod.plan([fed])  # still in its window
    assert (0, 0) in prod.ready and prod.variants
    fed.next_pos = 1
    prod.plan([fed])  # left every window: the payload and its variants go
    assert not prod.ready and not prod.variants
