"""How a service starts and ends around its users: their folders kept, a live endpoint refused,
ranks that stop after a fixed step count ending the run, a long ``TMPDIR`` served, and worker
restarts counted over a window (each failed before the fix that came with it)."""

from __future__ import annotations

import tempfile
import time

import pytest
from entrain_data.workers.pool import WorkerPool
from test_service import dataset, make_plan, start  # noqa: F401  (dataset: a fixture)

from entrain_data.client import EntrainLoader
from entrain_data.errors import InvalidInput

pytestmark = pytest.mark.timeout(120)


def _take_exactly(svc, ranks, count: int) -> None:
    """Each rank reads exactly ``count`` microbatches with next(), as a fixed-step loop does."""
    loaders = [EntrainLoader(svc.endpoint, r, prefetch=2, timeout=30) for r in ranks]
    its = [iter(ld) for ld in loaders]
    try:
        for _ in range(count):
            for it in its:
                next(it)
    finally:
        for ld in loaders:
            ld.close()


def test_the_users_endpoint_folder_and_its_files_outlive_the_service(tmp_path, dataset):  # noqa: F811
    """The endpoint's folder was removed whole at stop when its name began with 'entrain-'."""
    folder = tmp_path / "entrain-myrun"
    folder.mkdir()
    (folder / "checkpoint-1000.pt").write_bytes(b"weights")
    svc = start(tmp_path, dataset, make_plan(), endpoint=f"ipc://{folder}/svc.sock")
    try:
        _take_exactly(svc, [0, 1], 1)
    finally:
        svc.close()
    assert (folder / "checkpoint-1000.pt").read_bytes() == b"weights"
    assert not (folder / "svc.sock").exists()
    assert not (tmp_path / "entrain-sock").exists()  # the folder the service made is gone


def test_an_endpoint_a_live_service_listens_on_is_refused(tmp_path, dataset):  # noqa: F811
    """A second service bound over the first one's ipc path, and the first one's stop then
    unlinked the second's socket."""
    ep = f"ipc://{tmp_path}/svc.sock"
    svc = start(tmp_path, dataset, make_plan(), endpoint=ep)
    try:
        _take_exactly(svc, [0], 1)  # it listens
        with pytest.raises(InvalidInput, match="is in use"):
            start(tmp_path, dataset, make_plan(), endpoint=ep).close()
    finally:
        svc.close()
    start(tmp_path, dataset, make_plan(), endpoint=ep).close()  # free again once it stopped
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")  # a bind would have replaced the user's file with a socket
    with pytest.raises(InvalidInput, match="exists and is not a socket"):
        start(tmp_path, dataset, make_plan(), endpoint=f"ipc://{notes}").close()
    assert notes.read_text() == "mine"


def test_ranks_that_stop_after_exactly_their_microbatches_end_the_service(tmp_path, dataset):  # noqa: F811
    """The last credit went only when the generator resumed: a fixed-step loop that closed
    after its last microbatch left the service running."""
    svc = start(tmp_path, dataset, make_plan())
    try:
        _take_exactly(svc, [0, 1], 4 * 3)  # 4 iterations x 3 microbatches, one epoch
        assert svc.wait(15) == 0
    finally:
        svc.close()


def test_a_long_tmpdir_serves_the_rank_instead_of_failing(tmp_path, dataset, monkeypatch):  # noqa: F811
    """A socket path is at most 107 bytes; a Kubernetes emptyDir TMPDIR is about 95. Both the
    service's own sockets and the rank's data socket were bound there and failed."""
    from entrain_data.workers.sample_source import CustomSource
    from entrain_data.workers.service import start_service
    from test_service import IndexKeys, TarTextPacker, TextCosts

    long = tmp_path / ("d" * 60) / ("e" * 60)
    long.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    source = CustomSource(
        TarTextPacker(str(dataset), "raise", -1, str(tmp_path / "died")),
        TextCosts(str(dataset)),
        IndexKeys(str(dataset)),
    )
    svc = start_service(plan=make_plan(), source=source, workers=1)  # its sockets: a temp dir
    try:
        _take_exactly(svc, [0, 1], 2)
    finally:
        svc.close()
    assert not list(long.iterdir())  # no service or rank folder left behind


def test_worker_restarts_count_over_a_window_not_the_whole_run():
    pool = WorkerPool.__new__(WorkerPool)  # the counter alone: no processes
    now = time.monotonic()
    pool._deaths = [now - 3600.0] * 30 + [now - 5.0] * 2
    assert pool.recent_restarts() == 2
