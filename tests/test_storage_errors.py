"""Object-storage failures named for what they are, retried when transient, skipped per sample.

A real HTTP server on loopback (Range GETs, as fsspec's ``https://`` path uses) with injected
faults, and moto's S3 server with its authentication switched on (a credential S3 does not know)
or an endpoint nobody listens on. Retry waits are set to zero: the tests count requests, not time.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from entrain_data.workers import storage
from entrain_data.workers.parquet_source import ParquetSource
from entrain_data.workers.sources import TarShard, expand_paths

from entrain_data.errors import InvalidInput, SampleError

pytestmark = [pytest.mark.timeout(120)]

DROP = 0
"""A fault that closes the connection without answering (a reset, as a proxy restart does)."""


class _Files(BaseHTTPRequestHandler):
    """Files of ``server.root`` with Range support; ``server.faults[path]``: statuses (or DROP)
    answered to the next GETs instead of the file; ``server.broken[path]``: a status answered to
    every request, HEAD included."""

    def log_message(self, *args: object) -> None:
        pass

    def _fault(self) -> int | None:
        srv = self.server
        with srv.lock:  # type: ignore[attr-defined]
            srv.requests.append((self.command, self.path))  # type: ignore[attr-defined]
            if self.path in srv.broken:  # type: ignore[attr-defined]
                return srv.broken[self.path]  # type: ignore[attr-defined]
            queue = srv.faults.get(self.path)  # type: ignore[attr-defined]
            if self.command == "GET" and queue:
                return queue.pop(0)
        return None

    def _answer(self, body: bool) -> None:
        fault = self._fault()
        if fault == DROP:
            self.close_connection = True
            return
        if fault is not None:
            self.send_response(fault)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = Path(self.server.root) / self.path.lstrip("/")  # type: ignore[attr-defined]
        if not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = path.read_bytes()
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if m:
            lo = int(m.group(1))
            hi = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
            data_out = data[lo : hi + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {lo}-{hi}/{len(data)}")
        else:
            data_out = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(data_out)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if body:
            self.wfile.write(data_out)

    def do_HEAD(self) -> None:  # noqa: N802 - the http.server protocol
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)


@contextlib.contextmanager
def http_files(root: Path) -> Iterator[ThreadingHTTPServer]:
    """A loopback HTTP server of ``root``'s files (``server.url``), shut down on exit."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    srv.daemon_threads = True
    srv.root, srv.lock = str(root), threading.Lock()  # type: ignore[attr-defined]
    srv.faults, srv.broken, srv.requests = {}, {}, []  # type: ignore[attr-defined]
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"  # type: ignore[attr-defined]
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: connecting is refused, and no one can take it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def gets(srv: ThreadingHTTPServer, path: str) -> int:
    return sum(1 for m, p in srv.requests if m == "GET" and p == path)  # type: ignore[attr-defined]


@pytest.fixture
def files(tmp_path, monkeypatch) -> Iterator[ThreadingHTTPServer]:
    """A tar shard ``s.tar`` (4 samples) and a table ``t.parquet`` (3 row groups) over HTTP."""
    monkeypatch.setattr(storage, "RETRY_BACKOFF_S", 0.0, raising=False)
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for i in range(4):
            for ext, data in (("txt", f"caption {i}".encode()), ("bin", bytes([i]) * 3000)):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    pad = [b"x" * 200_000] * 30  # 2 MB a row group: past the 1 MiB read-ahead of the one before
    table = pa.table({"text": [f"row {i}" for i in range(30)], "pad": pad})
    pq.write_table(
        table, tmp_path / "t.parquet", row_group_size=10, compression="none", use_dictionary=False
    )
    with http_files(tmp_path) as srv:
        yield srv


def test_failure_kinds():
    assert storage.failure_kind(FileNotFoundError("b/k")) == "missing"
    assert storage.failure_kind(PermissionError("Forbidden")) == "denied"
    assert storage.failure_kind(ConnectionRefusedError()) == "unreachable"
    assert storage.failure_kind(ConnectionResetError()) == "transient"
    wrapped = FileNotFoundError("https://h/x")  # fsspec HTTP's _info wraps what HEAD/GET got
    wrapped.__cause__ = ConnectionResetError()
    assert storage.failure_kind(wrapped) == "transient"


def test_http_is_file_tells_missing_from_denied_and_unreachable(files):
    base = files.url
    assert storage.is_file(f"{base}/s.tar") and not storage.is_file(f"{base}/nope.tar")
    with pytest.raises(InvalidInput, match="not found"):
        expand_paths(f"{base}/nope.tar")
    files.broken["/s.tar"] = 403
    with pytest.raises(InvalidInput, match=rf"{base}/s\.tar: permission denied") as err:
        expand_paths(f"{base}/s.tar")
    assert "not found" not in str(err.value)
    files.broken["/s.tar"] = 500
    with pytest.raises(InvalidInput, match=r"s\.tar: the storage service keeps failing.*500"):
        storage.is_file(f"{base}/s.tar")
    with closed_port() as port, pytest.raises(InvalidInput, match="cannot reach the storage"):
        expand_paths(f"http://127.0.0.1:{port}/s.tar")


def test_transient_http_errors_are_retried(files):
    url = f"{files.url}/s.tar"
    local = TarShard(os.path.join(files.root, "s.tar"))
    shard = TarShard(url)  # random access: one ranged GET per sample
    before = gets(files, "/s.tar")
    files.faults["/s.tar"] = [503, DROP, 429]
    assert shard.read("0002") == local.read("0002")
    assert gets(files, "/s.tar") - before == 4  # three failures, then the read
    files.faults["/s.tar"] = [502]
    assert storage.read_all(url) == Path(files.root, "s.tar").read_bytes()
    seq = TarShard(url, block_size=1024, sequential=True)  # reads through the file's read-ahead
    files.faults["/s.tar"] = [503, 503]
    assert seq.read("0003") == local.read("0003")
    assert files.faults["/s.tar"] == []


def test_persistent_http_error_fails_naming_the_object(files):
    url = f"{files.url}/s.tar"
    shard = TarShard(url)
    before = gets(files, "/s.tar")
    files.faults["/s.tar"] = [503] * 10
    with pytest.raises(SampleError, match=rf"{url}: sample '0001'.*503.*after 4 tries") as err:
        shard.read("0001")
    assert (err.value.source, err.value.key) == (url, "0001")
    assert gets(files, "/s.tar") - before == storage.RETRY_ATTEMPTS
    files.faults["/s.tar"] = [404, 404]  # not transient: one try
    with pytest.raises(FileNotFoundError, match=re.escape(url)):
        storage.read_range(url, 0, 10)
    assert files.faults["/s.tar"] == [404]


def test_parquet_over_http_server_error_is_a_sample_error(files):
    url = f"{files.url}/t.parquet"
    src = ParquetSource(url)
    assert src.read(3, ["text"]) == {"text": "row 3"}
    files.broken["/t.parquet"] = 500
    with pytest.raises(SampleError, match=rf"{url}: row 15 \(row group 1\) unreadable.*500") as e:
        src.read(15, ["text"])
    assert (e.value.source, e.value.key) == (url, "15")
    files.broken["/t.parquet"] = 403
    with pytest.raises(SampleError, match=r"not a readable Parquet table.*403"):
        ParquetSource(url)


def test_parquet_over_http_server_error_is_skipped_by_the_packer(files, tmp_path):
    from entrain_data.workers.index_builder import build_index
    from entrain_data.workers.packing import make_packer

    from entrain_data.metadata import write_index

    url = f"{files.url}/t.parquet"
    index = tmp_path / "index.parquet"
    write_index(build_index(url, progress=False, parquet_columns={"text": "text"}), index)
    packer = make_packer(str(index), on_error="skip")
    assert packer([0, 1], [0, 1]).skipped == []
    files.broken["/t.parquet"] = 500
    out = packer([25, 26], [25, 26])
    assert sorted(s["key"] for s in out.skipped) == ["t.parquet:25", "t.parquet:26"]
    assert all(s["source"] == url and "500" in s["error"] for s in out.skipped)


def test_parquet_row_group_cache_keys_the_columns(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"], "image": [b"1", b"2", b"3"]}), path)
    src = ParquetSource(path)
    assert src.read(0, ["text"]) == {"text": "a"}
    assert src.read(1, ["text", "image"]) == {"text": "b", "image": b"2"}
    assert src.read(2) == {"text": "c", "image": b"3"}
    assert src.read(0, ["image"]) == {"image": b"1"}


def _moto():
    """moto's S3 server (its auth off until a test switches it on)."""
    from _s3 import s3_server

    pytest.importorskip("s3fs", reason="s3fs (test extra) not installed")
    pytest.importorskip("moto.server", reason="moto[server] (test extra) not installed")
    return s3_server()


def test_s3_bad_credentials_are_permission_denied(monkeypatch):
    import s3fs
    from moto import settings

    with _moto():
        fs = s3fs.S3FileSystem()
        fs.mkdir("data")
        fs.pipe_file("data/x.tar", b"\0" * 10240)
        with pytest.raises(InvalidInput, match="not found: s3://data/nope.tar"):
            expand_paths("s3://data/nope.tar")
        # from here on moto checks every request's signature: 'testing' is a key S3 does not know
        monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        with pytest.raises(InvalidInput, match=r"s3://data/x\.tar: permission denied") as err:
            expand_paths("s3://data/x.tar")
        assert "not found" not in str(err.value)
        with pytest.raises(PermissionError, match=r"s3://data/x\.tar: .*Access Key Id"):
            storage.read_range("s3://data/x.tar", 0, 10)


def test_s3_unreachable_endpoint_is_not_not_found(monkeypatch):
    pytest.importorskip("s3fs", reason="s3fs (test extra) not installed")
    import s3fs

    with closed_port() as port:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries: one try, the test stays quick
        }.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            with pytest.raises(InvalidInput, match=r"s3://data/x\.tar: cannot reach the storage"):
                expand_paths("s3://data/x.tar")
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
