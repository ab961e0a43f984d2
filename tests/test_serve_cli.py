"""``entrain-data serve`` as a user meets it: bad input is one line and exit 2, a Ctrl-C in a
terminal (SIGINT to the whole process group) stops everything at once, and a failed start leaves
no ``entrain-*`` folder behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_service import make_index_plan, make_shards

from entrain_data.client import EntrainLoader
from entrain_data.errors import ServiceStopped

pytestmark = pytest.mark.timeout(120)


def _serve(*args: str, tmp, **kw) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.Popen(
        [sys.executable, "-m", "entrain_data.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **kw,
    )


@pytest.fixture
def inputs(tmp_path):
    index = make_shards(tmp_path)
    plan = make_index_plan().save(tmp_path / "plan.json")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return index, plan, tmp


def _one_line_exit_2(p: subprocess.Popen, *needles: str) -> str:
    out, _ = p.communicate(timeout=90)
    lines = out.strip().splitlines()
    assert p.returncode == 2, out
    assert len(lines) == 1 and lines[0].startswith("entrain-data: error: "), out
    for needle in needles:
        assert needle in lines[0], out
    return lines[0]


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.mark.parametrize(
    "case",
    [
        "no-scheme",
        pytest.param("port-99999", marks=pytest.mark.slow),
        pytest.param("parquet-plan", marks=pytest.mark.slow),
        "port-in-use",
        pytest.param("bad-index", marks=pytest.mark.slow),
    ],
)
def test_bad_serve_input_is_one_line_exit_2_and_leaves_no_temp_folder(inputs, case):
    index, plan, tmp = inputs
    args = ["--index", str(index), "--plan", str(plan)]
    busy = None
    if case == "no-scheme":
        p = _serve(*args, "--endpoint", "localhost:5555", tmp=tmp)
        _one_line_exit_2(p, "localhost:5555", "tcp://HOST:PORT")
    elif case == "port-99999":
        p = _serve(*args, "--endpoint", "tcp://127.0.0.1:99999", tmp=tmp)
        _one_line_exit_2(p, "1..65535")
    elif case == "parquet-plan":
        p = _serve("--index", str(index), "--plan", str(index), tmp=tmp)
        _one_line_exit_2(p, "index.parquet", "not a plan")
    elif case == "port-in-use":
        busy = _busy_port()
        port = busy.getsockname()[1]
        p = _serve(*args, "--endpoint", f"tcp://127.0.0.1:{port}", tmp=tmp)
        _one_line_exit_2(p, f"tcp://127.0.0.1:{port}", "already in use")
        busy.close()
    else:
        bad = index.parent / "corrupt.parquet"
        bad.write_bytes(b"PAR1 not really a parquet file")
        p = _serve("--index", str(bad), "--plan", str(plan), tmp=tmp)
        _one_line_exit_2(p, "corrupt.parquet")
    assert list(tmp.glob("entrain-*")) == []


def test_ctrl_c_in_a_terminal_is_one_line_and_stops_the_workers_at_once(inputs, tmp_path):
    """A terminal's Ctrl-C is SIGINT to the whole foreground process group: workers included."""
    import psutil

    index, plan, tmp = inputs
    sock = tmp_path / "svc.sock"
    srv = _serve(
        "--index", str(index), "--plan", str(plan), "--endpoint", f"ipc://{sock}",
        "--stats-interval", "0", tmp=tmp, start_new_session=True,
    )  # fmt: skip
    ld = EntrainLoader(f"ipc://{sock}", 0, prefetch=1, timeout=60)
    try:
        it = iter(ld)
        next(it)
        workers = psutil.Process(srv.pid).children(recursive=True)
        assert len(workers) >= 2  # the workers (and multiprocessing's resource tracker)
        t0 = time.monotonic()
        os.killpg(srv.pid, signal.SIGINT)
        out, _ = srv.communicate(timeout=30)
        took = time.monotonic() - t0
        with pytest.raises(ServiceStopped, match="SIGINT"):
            for _ in range(100):
                next(it)
    finally:
        ld.close()
        if srv.poll() is None:
            srv.kill()
    assert srv.returncode == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "restart" not in out, out
    lines = out.strip().splitlines()  # the banner, then one line
    assert len(lines) == 2 and "stopped by SIGINT" in lines[1] and "workers stopped" in lines[1], (
        out
    )
    assert took < 4.0, (took, out)
    deadline = time.monotonic() + 3  # the resource tracker exits once its pipe closes
    while left := [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, [(w.pid, w.cmdline()[-1:]) for w in left]
        time.sleep(0.1)
    assert not sock.exists() and list(tmp.glob("entrain-*")) == []


def test_the_worker_key_argument_the_service_prints_parses_back_for_every_key():
    # a Z85 key starts with '-' one time in 85 (argparse then read it as an option and the
    # remote worker exited: "expected one argument") and holds shell characters
    import shlex

    from entrain_data.workers.cli import worker_key_argument

    from entrain_data.cli import build_parser

    for key in (b"-" + b"a" * 39, b"j$O/&FC*!gX>fHZ?Ns5gdex.i!yQmMS!.gK6[q(F", b"--" + b"x" * 38):
        words = ["worker", "--connect", "tcp://127.0.0.1:5556", "--index", "i", "--plan", "p"]
        args = build_parser().parse_args(words + shlex.split(worker_key_argument(key)))
        assert args.curve_server_key == key.decode()
