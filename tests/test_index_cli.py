"""``entrain-data index`` as a user runs it (issue 15): quiet means quiet, help says what it does.

Run as a subprocess, so logging is configured exactly as on a terminal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

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
    assert "no sample could be indexed: every one found was skipped (3; keys" in p.stderr
    assert len((tmp_path / "index.parquet.skipped.jsonl").read_text().splitlines()) == 3


def test_inputs_without_samples_say_why_and_write_no_skipped_file(tmp_path):
    """An empty shard or a folder of text files said "0 skipped; keys and errors in FILE" (an
    empty file), and -q hid the one useful line (what the folder passed over)."""
    import tarfile

    tarfile.open(tmp_path / "empty.tar", "w").close()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("no picture")
    (notes / "b.txt").write_text("none here either")
    index = tmp_path / "index.parquet"
    for given, why in (
        ("empty.tar", "empty.tar (no samples in it)"),
        ("notes", "notes (passed over 2 file group(s) without an image or audio file)"),
    ):
        p = run_index(str(tmp_path / given), "-o", str(index), "-q")
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert f"no sample found in 1 input: {tmp_path / why}" in p.stderr
        assert "skipped" not in p.stderr
    assert not index.exists() and not list(tmp_path.glob("*.skipped.jsonl"))


def test_a_folder_of_shards_indexes_its_shards_as_a_glob_does(tmp_path, shared_data):
    """It said "no sample could be indexed (0 skipped ...)": a folder was only loose files."""
    from entrain_data.metadata import read_index

    shards = tmp_path / "shards2"
    shards.mkdir()
    for name in ("compressed.tar", "testgz.tar"):
        (shards / name).symlink_to(shared_data / "webdataset_testdata" / name)
    (shards / "notes.json").write_text("{}")  # passed over, as beside shards under a prefix
    p = run_index(str(shards), "-o", str(tmp_path / "a.parquet"), "-q")
    assert p.returncode == 0, p.stderr
    p = run_index(str(shards / "*.tar"), "-o", str(tmp_path / "b.parquet"), "-q")
    assert p.returncode == 0, p.stderr
    a, b = read_index(tmp_path / "a.parquet"), read_index(tmp_path / "b.parquet")
    assert len(a) > 1000 and list(a.keys) == list(b.keys)
    assert sorted({str(s) for s in a.sources}) == [
        str(shards / "compressed.tar"),
        str(shards / "testgz.tar"),
    ]


def test_a_folder_with_loose_media_beside_shards_stays_loose_files(tmp_path, shared_data):
    from entrain_data.workers.index_builder import build_index

    src = shared_data / "webdataset_testdata"
    t = build_index(str(src), progress=False)
    assert len(t) == 6 and all(str(s) == str(src) for s in t.sources)  # dlinputs/, not the tars


def test_output_that_is_a_folder_is_refused_before_indexing(tmp_path):
    """It crashed after the work (IsADirectoryError 'sub.tmp' -> 'sub') and left sub.tmp."""
    (tmp_path / "sub").mkdir()
    p = run_index(str(tmp_path / "nothing-here.tar"), "-o", str(tmp_path / "sub"), "-q")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert (
        p.stderr
        == f"entrain-data: error: index {tmp_path / 'sub'}: is a folder, give a file path\n"
    )
    assert sorted(x.name for x in tmp_path.iterdir()) == ["sub"]


def test_a_failed_index_write_leaves_no_temp_file(tmp_path, monkeypatch):
    from entrain_data.workers.index_builder import build_index

    from entrain_data import metadata

    shard = write_shard(tmp_path / "s.tar", {"good": BAD["good"]})
    table = build_index(str(shard), progress=False)

    def full_disk(table, where, **kw):
        Path(where).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metadata.pq, "write_table", full_disk)
    with pytest.raises(OSError, match="No space"):
        metadata.write_index(table, tmp_path / "i.parquet")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["s.tar"]
    with pytest.raises(metadata.InvalidInput, match="is a folder"):
        metadata.write_index(table, tmp_path)
