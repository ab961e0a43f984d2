"""``entrain-data index`` as a user runs it (issue 15): quiet means quiet, help says what it does.

Run as a subprocess, so logging is configured exactly as on a terminal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from test_index_builder import BAD, write_shard

pytestmark = [pytest.mark.timeout(120)]


def run_index(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "entrain_data.cli", "index", *args],
        capture_output=True,
        text=True,
        timeout=100,
    )


def test_skip_quiet_is_one_summary_line(tmp_path):
    bad = {f"bad{i:03d}": BAD["notext"] for i in range(30)}
    shard = write_shard(tmp_path / "bad.tar", {"good": BAD["good"], **bad})
    index = tmp_path / "index.parquet"
    p = run_index(str(shard), "-o", str(index), "--on-error", "skip", "-q")
    assert p.returncode == 0, p.stderr
    lines = (p.stdout + p.stderr).splitlines()
    where = f"{index}.skipped.jsonl"
    assert lines == [f"skipped 30 sample(s); keys and errors in {where}"]
    with open(where) as f:
        written = [json.loads(s) for s in f]
    assert sorted(s["key"] for s in written) == sorted(bad)
    mine = tmp_path / "s.jsonl"
    p = run_index(str(shard), "-o", str(index), "--on-error", "skip", "--skipped", str(mine))
    assert p.returncode == 0 and "wrote " in p.stdout and "skipping" not in p.stderr
    assert p.stderr.splitlines()[-1] == f"skipped 30 sample(s); keys and errors in {mine}"
    assert len(mine.read_text().splitlines()) == 30


def _index_parser() -> argparse.ArgumentParser:
    from entrain_data.workers.cli import register

    parser = argparse.ArgumentParser(prog="entrain-data")
    register(parser.add_subparsers())
    return parser._subparsers._group_actions[0].choices["index"]


def test_every_index_option_has_help_and_shows_its_default():
    parser = _index_parser()
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings or action.dest} has no help"
        if action.option_strings and action.default not in (None, False):
            assert f"(default: {action.default})" in " ".join(text.split()), action.dest
    for opt in ("--tokenizer", "--metadata", "--skipped"):  # defaults that are not a value
        act = next(a for a in parser._actions if opt in a.option_strings)
        assert "default:" in act.help, opt


def test_tokenizer_help_says_what_the_default_counts():
    act = next(a for a in _index_parser()._actions if "--tokenizer" in a.option_strings)
    assert "estimate" not in act.help
    assert "UTF-8 byte" in act.help and "4x" in act.help and "exact" in act.help


def test_quiet_folder_index_prints_nothing(tmp_path):
    from PIL import Image

    folder = tmp_path / "photos"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    (folder / "a.txt").write_text("a black square")
    (folder / "README.md").write_text("not a sample")  # passed over: a note, unless -q
    index = tmp_path / "index.parquet"
    p = run_index(str(folder), "-o", str(index), "-q")
    assert p.returncode == 0 and p.stdout == p.stderr == ""
    p = run_index(str(folder), "-o", str(index))
    assert "passed over 1 file group(s)" in p.stderr and "wrote " in p.stdout


def test_quiet_in_process_leaves_the_callers_logging_as_it_was(tmp_path, capsys):
    """``main(["index", ..., "-q"])`` set the package's logger to ERROR for good: a notebook (or
    a test) calling it lost every later warning."""
    import logging

    from PIL import Image

    from entrain_data.cli import main

    folder = tmp_path / "photos"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    (folder / "a.txt").write_text("a black square")
    pkg = logging.getLogger("entrain_data")
    before = pkg.level
    assert main(["index", str(folder), "-o", str(tmp_path / "index.parquet"), "-q"]) == 0
    assert pkg.level == before


def test_an_index_where_every_sample_was_skipped_is_refused(tmp_path):
    """It was written with 0 samples and exit 0, to fail later at plan or serve."""
    shard = write_shard(tmp_path / "bad.tar", {f"b{i}": BAD["notext"] for i in range(3)})
    index = tmp_path / "index.parquet"
    p = run_index(str(shard), "-o", str(index), "--on-error", "skip", "-q")
    assert p.returncode == 2 and not index.exists()
    assert "no sample could be indexed (3 skipped" in p.stderr
    assert len((tmp_path / "index.parquet.skipped.jsonl").read_text().splitlines()) == 3
