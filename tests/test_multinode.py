"""One job on many nodes (issue 13 item 3) and elastic resume (item 5), on loopback.

Two services stand for two nodes (``ranks=(0, 1)`` and ``(2, 3)`` of a dp-4 plan): each
computes the same global schedule, serves only its own ranks and exits when they are
done. Services of one job that disagree (another seed) are refused on every rank when
torch.distributed is initialised. A checkpoint taken under dp 4 resumes under dp 2.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from _dist import run_ranks as run_dist
from test_service import close_all, make_plan, make_shards, run_ranks, start

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput, ProtocolError
from entrain_data.metadata import read_index

pytestmark = pytest.mark.timeout(240)


def _node(tmp_path: Path, index: Path, ranks: tuple[int, int], name: str, **kw):
    return start(tmp_path / name, index, make_plan(dp=4), ranks=ranks, **kw)


def _seq(out):
    return {
        r: [(m.iteration, m.microbatch, m.encoder_keys, m.llm_keys) for m in v]
        for r, v in out.items()
    }


@pytest.mark.slow
def test_two_nodes_serve_one_job_exactly_once_and_exit_by_themselves(tmp_path):
    index = make_shards(tmp_path)
    (tmp_path / "n0").mkdir()
    (tmp_path / "n1").mkdir()
    nodes = [_node(tmp_path, index, (0, 1), "n0"), _node(tmp_path, index, (2, 3), "n1")]
    try:
        loaders = [
            EntrainLoader(nodes[r // 2].endpoint, r, prefetch=2, timeout=60) for r in range(4)
        ]
        with pytest.raises(ProtocolError, match=r"not served here .*ranks 0\.\.1"):
            EntrainLoader(nodes[0].endpoint, 3, timeout=20).info  # noqa: B018
        its = [iter(ld) for ld in loaders]
        out = {r: [next(its[r])] for r in range(4)}
        victim = loaders[2].stats()["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)  # a worker of node 1 dies mid-epoch
        for r in range(4):
            out[r].extend(its[r])
        keys = list(read_index(index).keys)
        assert sorted(k for v in out.values() for m in v for k in m.llm_keys) == sorted(keys)
        assert sorted(k for v in out.values() for m in v for k in m.encoder_keys) == sorted(keys)
        fps = {ld.state_dict()["fingerprint"] for ld in loaders}
        assert len(fps) == 1  # both nodes serve the same stream
        close_all(loaders)
        assert [n.wait(30) for n in nodes] == [0, 0]  # each exits once its own ranks are done
    finally:
        for n in nodes:
            n.close()
    # the same schedule as one service serving all four ranks
    one = start(tmp_path / "n0", index, make_plan(dp=4))
    try:
        ref, loaders = run_ranks(one.endpoint, [0, 1, 2, 3])
        close_all(loaders)
    finally:
        one.close()
    assert _seq(ref) == _seq(out)


def _disagreeing_rank(rank: int, world: int, endpoints: list[str], result_dir: str) -> None:
    ld = EntrainLoader(endpoints[rank], rank, timeout=60)
    try:
        ld.info  # noqa: B018  # the first use compares fingerprints across the job
    except InvalidInput as exc:
        Path(result_dir, f"rank{rank}.txt").write_text(str(exc))
    finally:
        ld.close()


@pytest.mark.slow
def test_services_of_one_job_with_different_seeds_are_refused_on_every_rank(tmp_path):
    index = make_shards(tmp_path)
    for name in ("n0", "n1"):
        (tmp_path / name).mkdir()
    plan = make_plan(dp=2)
    nodes = [
        start(tmp_path / "n0", index, plan, ranks=(0, 0), seed=1),
        start(tmp_path / "n1", index, plan, ranks=(1, 1), seed=2),
    ]
    try:
        run_dist(_disagreeing_rank, [n.endpoint for n in nodes], str(tmp_path), world=2)
    finally:
        for n in nodes:
            n.close()
    for r in (0, 1):
        text = (tmp_path / f"rank{r}.txt").read_text()
        assert "disagree" in text and "same plan, seed" in text


@pytest.mark.slow  # 15-26 s on 2 cores (the default run stays near 10 minutes)
def test_a_dp4_checkpoint_resumes_under_dp2_with_nothing_lost_or_repeated(tmp_path):
    """In the default run (15 s): the direct route once dropped the resumed iteration's first
    microbatch (the rank kept the checkpoint's position, not the one the service gave it)."""
    index = make_shards(tmp_path)
    keys = list(read_index(index).keys)
    svc = start(tmp_path, index, make_plan(dp=4), seed=9)
    try:  # dp 4: stop in the middle of iteration 1 (microbatch 1 of 3)
        part, loaders = run_ranks(svc.endpoint, [0, 1, 2, 3], limit=4)
        states = [ld.state_dict() for ld in loaders]
        close_all(loaders)
    finally:
        svc.close()
    assert {(s["iteration"], s["microbatch"]) for s in states} == {(1, 1)}
    done = [k for v in part.values() for m in v if m.iteration < 1 for k in m.llm_keys]
    svc = start(tmp_path, index, make_plan(dp=2), seed=9)
    try:  # dp 2: ranks 0 and 1 resume from the old ranks 0 and 1
        loaders = [EntrainLoader(svc.endpoint, r, prefetch=2, timeout=60) for r in (0, 1)]
        for ld in loaders:
            ld.load_state_dict(states[ld.rank])
        rest = {ld.rank: list(ld) for ld in loaders}
        assert {(v[0].iteration, v[0].microbatch) for v in rest.values()} == {(1, 0)}
        close_all(loaders)
    finally:
        svc.close()
    after = [k for v in rest.values() for m in v for k in m.llm_keys]
    assert sorted(done + after) == sorted(keys)  # iteration 1 again, whole, under the new plan
