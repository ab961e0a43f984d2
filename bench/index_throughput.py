"""Index throughput over object storage against local files: samples/s and requests per shard.

The shards are real COCO images with their captions (../shared/data/coco_mini) written as tar
shards; the same shards are indexed from local disk and from ``s3://`` served by moto's S3 server
on loopback (in this process, on its own threads: its CPU is counted against the S3 figure).
Requests are counted where the server logs them (werkzeug's access log), so every HEAD and
ranged GET the index makes is in the count, whoever issued it.

    python bench/index_throughput.py --shards 8 --per-shard 20 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import socket
import statistics
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, SHARED_DATA  # noqa: E402

_REQUEST = re.compile(r"(GET|HEAD|PUT|POST|DELETE) /\S* HTTP/")


class _RequestCounter(logging.Handler):
    """Counts the S3 server's access-log lines by HTTP method."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = _REQUEST.search(record.getMessage())  # the line may carry ANSI colour codes
        if m:
            self.counts[m.group(1)] = self.counts.get(m.group(1), 0) + 1

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {}
        return out


def write_shards(root: Path, shards: int, per_shard: int) -> list[Path]:
    rows = [json.loads(x) for x in (SHARED_DATA / "coco_mini" / "captions.jsonl").open()]
    if shards * per_shard > len(rows):
        raise SystemExit(f"coco_mini has {len(rows)} images; asked for {shards * per_shard}")
    paths = []
    for s in range(shards):
        path = root / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for r in rows[s * per_shard : (s + 1) * per_shard]:
                stem = r["file_name"].rsplit(".", 1)[0]
                for name, data in (
                    (f"{stem}.jpg", (SHARED_DATA / "coco_mini" / r["path"]).read_bytes()),
                    (f"{stem}.txt", r["captions"][0].encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from entrain_data.workers.index_builder import build_index
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    counter = _RequestCounter()
    wlog = logging.getLogger("werkzeug")
    wlog.setLevel(logging.INFO)
    wlog.propagate = False
    wlog.addHandler(counter)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=url,
    )
    try:
        import s3fs

        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
        with tempfile.TemporaryDirectory() as tmp:
            paths = write_shards(Path(tmp), args.shards, args.per_shard)
            fs = s3fs.S3FileSystem()
            fs.mkdir("bench")
            for p in paths:
                fs.put_file(str(p), f"bench/{p.name}")
            total_mb = sum(p.stat().st_size for p in paths) / 1e6
            last = args.shards - 1
            inputs = {
                "local": f"{tmp}/shard-{{000..{last:03d}}}.tar",
                "s3": f"s3://bench/shard-{{000..{last:03d}}}.tar",
            }
            rows = []
            for name, pattern in inputs.items():
                times, reqs = [], []
                for _ in range(args.repeats):
                    s3fs.S3FileSystem.clear_instance_cache()
                    counter.take()
                    t0 = time.perf_counter()
                    table = build_index(pattern, progress=False)
                    times.append(time.perf_counter() - t0)
                    reqs.append(counter.take())
                n = len(table)
                t = statistics.median(times)
                per_shard = {m: c / args.shards for m, c in reqs[-1].items()}
                rows.append(
                    {
                        "source": name,
                        "samples": n,
                        "shards": args.shards,
                        "shard_mb": total_mb / args.shards,
                        "seconds_median": t,
                        "seconds_all": times,
                        "samples_per_s": n / t,
                        "requests_per_shard": per_shard,
                    }
                )
    finally:
        server.stop()
    base = rows[0]["samples_per_s"]
    print(f"{args.shards} shards x {args.per_shard} COCO samples ({total_mb:.1f} MB)")
    print(f"{'source':<6} {'samples/s':>10} {'ratio':>7} {'median s':>9}  requests per shard")
    for r in rows:
        reqs = ", ".join(f"{m} {c:.1f}" for m, c in sorted(r["requests_per_shard"].items()))
        print(
            f"{r['source']:<6} {r['samples_per_s']:>10.1f} {r['samples_per_s'] / base:>7.2f} "
            f"{r['seconds_median']:>9.3f}  {reqs or '0 (local)'}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "index_throughput.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
