"""A real S3 API on loopback for tests: moto's server mode on a free port, stopped after use."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.request
from collections.abc import Iterator

__all__ = ["s3_server"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """Start moto's S3 server, point the usual AWS variables at it; yields its endpoint URL.

    The variables go into ``os.environ`` (restored afterwards), so spawned worker processes find
    the server the way a user's job finds S3: through the environment, no code path of our own.
    """
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    url = f"http://127.0.0.1:{port}"
    new = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": url,
        **(env or {}),
    }
    old = {k: os.environ.get(k) for k in new}
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log lines in test output
    server.start()
    try:
        # moto keeps its buckets in this process across servers: start from an empty S3
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
        os.environ.update(new)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # a cached client would keep an old endpoint
        yield url
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
