"""``entrain-data demo`` end to end (slow: it trains two short runs on 2 CPU ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


@pytest.mark.timeout(600)
def test_demo_runs_end_to_end_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "demo"
    before = set(_children_of(os.getpid()))  # e.g. multiprocessing's resource tracker
    cmd = [
        sys.executable,
        "-m",
        "entrain_data.cli",
        "demo",
        "--out",
        str(out),
        "--samples",
        "128",
        "--global-batch",
        "32",
        "--microbatches",
        "2",
        "--timeout",
        "400",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "entrain vs sequential" in proc.stdout
    # the per-microbatch figure the README copies, and no all-zero time column in the profile
    assert "LLM forward time of rank 0's microbatches" in proc.stdout
    assert "iteration 2" in proc.stdout
    assert " 0.0000 " not in proc.stdout.split("batch-sum CV")[0]
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["method"]: r for r in summary["rows"]}
    assert set(rows) == {"sequential", "entrain"}
    for r in rows.values():
        assert r["steps"] >= 2 and r["microbatches"] > 0
        assert r["step_seconds_measured"] > 0 and r["step_seconds_simulated"] > 0
    assert (out / "plan.json").is_file() and (out / "index.parquet").is_file()
    left = [p for p in _children_of(os.getpid()) if p not in before]
    assert left == [], [(p, _cmdline(p)) for p in left]
