"""How a service starts and ends around its users: their folders kept, a live endpoint refused,
ranks that stop after a fixed step count ending the run, a long ``TMPDIR`` served, a rank that
says hello twice told at once, and worker restarts counted over a window (each failed before
the fix that came with it)."""

from __future__ import annotations

import socket
import tempfile
import time
from dataclasses import replace

import pytest
from entrain_data.workers.pool import WorkerPool
from test_service import (  # noqa: F401  (dataset: a fixture)
    assert_exactly_once,
    close_all,
    dataset,
    make_plan,
    run_ranks,
    start,
)

from entrain_data.client import EntrainLoader
from entrain_data.errors import AddressInUse, InvalidInput
from entrain_data.metadata import read_index

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
        with pytest.raises(AddressInUse, match="is in use") as err:  # typed, as a tcp port's
            start(tmp_path, dataset, make_plan(), endpoint=ep).close()
        assert err.value.endpoint == ep
    finally:
        svc.close()
    start(tmp_path, dataset, make_plan(), endpoint=ep).close()  # free again once it stopped
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")  # a bind would have replaced the user's file with a socket
    with pytest.raises(InvalidInput, match="exists and is not a socket"):
        start(tmp_path, dataset, make_plan(), endpoint=f"ipc://{notes}").close()
    assert notes.read_text() == "mine"


def test_two_services_started_together_on_one_ipc_path_one_is_refused(
    tmp_path,
    dataset,  # noqa: F811
    monkeypatch,
):
    """Both passed the probe (nobody listened yet), both bound, both said they served; the
    ranks reached only the second, and either one's stop unlinked the other's socket. Here the
    probe is passed by both (patched out): whichever claims the path first serves, the other
    stops with AddressInUse, and the stop leaves neither the socket nor its lock file."""
    from entrain_data.workers import service

    monkeypatch.setattr(service, "_ipc_taken", lambda ep: None)
    ep = f"ipc://{tmp_path}/svc.sock"
    (tmp_path / "svc.sock.lock").write_text("")  # what a service killed with SIGKILL leaves
    for name in "ab":
        (tmp_path / name).mkdir()  # each its own socket folder (the workers' sockets)
    both = [start(tmp_path / n, dataset, make_plan(), endpoint=ep) for n in "ab"]
    try:
        deadline = time.monotonic() + 60
        while all(h.alive() for h in both) and time.monotonic() < deadline:
            time.sleep(0.1)
        lost = [h for h in both if not h.alive()]
        assert len(lost) == 1, "both services still run on one path"
        assert isinstance(lost[0].failure(), AddressInUse), lost[0].failure()
        (won,) = [h for h in both if h.alive()]
        _take_exactly(won, [0, 1], 1)  # it serves: its socket file is its own
    finally:
        for h in both:
            h.close()
    assert not (tmp_path / "svc.sock").exists()
    assert not (tmp_path / "svc.sock.lock").exists()


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


def test_a_second_process_with_the_same_rank_is_told_at_once_which_one_is_dropped(
    tmp_path,
    dataset,  # noqa: F811
):
    """A second hello for a rank silently replaced the first connection, whose process then
    waited out its timeout (or trained on half the data) with no word why."""
    svc = start(tmp_path, dataset, make_plan())
    first = EntrainLoader(svc.endpoint, 0, prefetch=2, timeout=30)
    second = EntrainLoader(svc.endpoint, 0, prefetch=2, timeout=30)
    try:
        it = iter(first)
        next(it)
        assert next(iter(second)).iteration == 0  # the newer connection is served
        with pytest.raises(InvalidInput, match="rank 0 said hello from another connection"):
            for _ in range(12):  # what it holds already, then the error
                next(it)
    finally:
        first.close()
        second.close()
        svc.close()


def test_a_plan_whose_caps_the_index_cannot_meet_is_refused_at_start_naming_samples(
    tmp_path,
    dataset,  # noqa: F811
):
    """A plan made on another index served until the first global batch holding a sample over
    its caps, then stopped naming that sample by its place in the batch."""
    svc = start(tmp_path, dataset, replace(make_plan(), max_tokens=100))
    try:
        with pytest.raises(InvalidInput, match=r"24 sample\(s\) fit no .*s0-0001: 120 LLM tokens"):
            next(iter(EntrainLoader(svc.endpoint, 0, timeout=30, _service=svc)))
        assert svc.wait(15) != 0
    finally:
        svc.close()


def _free_v6_port() -> int | None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return int(s.getsockname()[1])
    except OSError:
        return None


def test_an_ipv6_endpoint_is_served(tmp_path, dataset):  # noqa: F811
    """``tcp://[::1]:P`` passed the endpoint check, then failed to bind ("No such device"):
    ZeroMQ leaves IPv6 off unless a socket asks."""
    port = _free_v6_port()
    if port is None:
        pytest.skip("this machine has no IPv6 loopback")
    svc = start(tmp_path, dataset, make_plan(), endpoint=f"tcp://[::1]:{port}")
    try:
        out, loaders = run_ranks(svc.endpoint, [0, 1])
        assert_exactly_once(out, list(read_index(dataset).keys))
        close_all(loaders)
    finally:
        svc.close()


def test_worker_restarts_count_over_a_window_not_the_whole_run():
    pool = WorkerPool.__new__(WorkerPool)  # the counter alone: no processes
    now = time.monotonic()
    pool._deaths = [now - 3600.0] * 30 + [now - 5.0] * 2
    assert pool.recent_restarts() == 2
