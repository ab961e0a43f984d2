"""Object-storage prefixes and globs as inputs, and how many requests expanding them costs.

A real S3 API (moto's server mode on loopback, :mod:`_s3`); the requests are counted by a spy
around the filesystem's own ``info`` (each one HEAD), the server answers them.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from _s3 import s3_server

from entrain_data.errors import InvalidInput

pytestmark = [pytest.mark.timeout(60)]

s3fs = pytest.importorskip("s3fs", reason="s3fs (test extra) not installed")
pytest.importorskip("moto.server", reason="moto[server] (test extra) not installed")

OBJECTS = (
    "shards/a-000.tar",
    "shards/a-001.tar",
    "shards/sub/b-000.tgz",
    "shards/t.parquet",
    "shards/README.md",
    "shards/.a-002.tar",  # hidden: an upload in progress, as a local folder's dot files
    "docs/notes.md",
    "docs/captions.jsonl",
    "meta/metadata.jsonl",
    "meta/images/1.jpg",
)


@pytest.fixture
def store():
    """``s3://data`` holding :data:`OBJECTS` (a few bytes each); yields the filesystem."""
    with s3_server():
        fs = s3fs.S3FileSystem()
        fs.mkdir("data")
        for name in OBJECTS:
            fs.pipe_file(f"data/{name}", b"x")
        yield fs


def _expand(patterns):
    from entrain_data.workers.sources import expand_paths

    return expand_paths(patterns)


class _Heads:
    """Counts the filesystem's ``info`` calls (one HEAD each) and how many run at once; each
    waits ``delay`` s first, so calls made one after another never overlap."""

    def __init__(self, fs, monkeypatch, delay: float = 0.0) -> None:
        self.calls: list[str] = []
        self.now = self.most = 0
        self._lock = threading.Lock()
        info = fs.info

        def spy(path, **kw):
            with self._lock:
                self.calls.append(path)
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(delay)
                return info(path, **kw)
            finally:
                with self._lock:
                    self.now -= 1

        monkeypatch.setattr(fs, "info", spy)  # the instance storage gets (fsspec caches it)


def test_prefix_expands_to_the_shards_and_tables_under_it(store):
    under = ["s3://data/shards/" + n for n in ("a-000.tar", "a-001.tar", "sub/b-000.tgz")]
    want = [*under[:2], "s3://data/shards/sub/b-000.tgz", "s3://data/shards/t.parquet"]
    want = sorted(want)
    assert _expand("s3://data/shards/") == want
    assert _expand("s3://data/shards") == want  # a key that is only a prefix, as a local folder
    assert _expand("s3://data/meta/") == ["s3://data/meta/metadata.jsonl"]  # read through it
    assert _expand(["s3://data/shards/a-*.tar", "s3://data/*/t.parquet"]) == [
        "s3://data/shards/a-000.tar",
        "s3://data/shards/a-001.tar",
        "s3://data/shards/t.parquet",
    ]
    assert _expand("s3://data/shards/**/*.tgz") == ["s3://data/shards/sub/b-000.tgz"]


def test_empty_prefix_and_unmatched_glob_say_so_naming_the_pattern(store):
    with pytest.raises(InvalidInput, match=r"no objects under s3://data/none/ \(from pattern"):
        _expand("s3://data/none/")
    with pytest.raises(InvalidInput, match=r"nothing matches s3://data/shards/\*\.zip \(from"):
        _expand("s3://data/shards/*.zip")
    with pytest.raises(InvalidInput, match=r"under s3://data/docs/, only 2 other objects") as e:
        _expand("s3://data/docs/")
    assert "name it: s3://data/docs/captions.jsonl" in str(e.value)
    with pytest.raises(InvalidInput, match=r"under s3://data/x-0/ \(from pattern .*x-\{0\.\.1\}/"):
        _expand("s3://data/x-{0..1}/")  # the pattern as given, the path its braces made
    with pytest.raises(InvalidInput, match=r"s3://data/shards/\*\*x: not a valid pattern"):
        _expand("s3://data/shards/**x")


def test_listed_objects_are_not_checked_again(store, monkeypatch):
    heads = _Heads(store, monkeypatch)
    assert len(_expand(["s3://data/shards/", "s3://data/shards/*.tar"])) == 4  # each once
    assert heads.calls == []  # one listing each, no HEAD per object listed


def test_explicit_paths_are_checked_concurrently(store, monkeypatch):
    for i in range(2, 24):
        store.pipe_file(f"data/shards/a-{i:03d}.tar", b"x")
    heads = _Heads(store, monkeypatch, delay=0.1)
    t0 = time.perf_counter()
    got = _expand("s3://data/shards/a-{000..023}.tar")
    assert got == [f"s3://data/shards/a-{i:03d}.tar" for i in range(24)]
    assert len(heads.calls) == 24 and heads.most > 1
    assert time.perf_counter() - t0 < 24 * 0.1  # one after another it takes at least this
    store.rm("data/shards/a-007.tar")
    with pytest.raises(InvalidInput, match=r"not found: s3://data/shards/a-007\.tar \(from"):
        _expand("s3://data/shards/a-{000..023}.tar")


def test_listing_denied_or_unreachable_is_not_not_found(store, monkeypatch):
    from moto import settings
    from test_storage_errors import closed_port

    assert len(_expand("s3://data/shards/")) == 4
    # from here on moto checks every request's signature: 'testing' is a key S3 does not know
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    for pattern in ("s3://data/shards/", "s3://data/shards/*.tar"):
        with pytest.raises(InvalidInput, match="permission denied") as err:
            _expand(pattern)
        assert pattern in str(err.value) and "not found" not in str(err.value)
        assert "no objects" not in str(err.value) and "nothing matches" not in str(err.value)
    with closed_port() as port:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries: one try
        s3fs.S3FileSystem.clear_instance_cache()
        for pattern in ("s3://data/shards/", "s3://data/shards/*.tar"):
            with pytest.raises(InvalidInput, match=r"cannot reach the storage endpoint") as err:
                _expand(pattern)
            assert pattern in str(err.value)


def test_local_glob_expands_as_a_shell_would(tmp_path):
    """A quoted glob (the Python API, a CLI argument in quotes) matches as the shell's would."""
    for name in ("s-000.tar", "s-001.tar", ".s-002.tar", "notes.md"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "photos").mkdir()
    got = _expand([str(tmp_path / "s-*.tar"), str(tmp_path / "*")])
    assert got == [str(tmp_path / n) for n in ("s-000.tar", "s-001.tar", "notes.md")]
    with pytest.raises(InvalidInput, match=r"nothing matches .*/x-\*\.tar \(from pattern"):
        _expand(str(tmp_path / "x-*.tar"))


TREE = (
    "loc/a.tar",
    "loc/sub/t.tar",
    "loc/sub/img/0.png",
    "loc/sub/img/0.txt",
    "loc/sub/.b.tar",
    "loc/.tmp/x.tar",
)


def test_local_and_remote_globs_yield_the_same_files(store, tmp_path):
    """One rule on both sides: a glob yields the files it matches, never a folder (a bucket has
    none), hidden names only where the pattern spells the dot."""
    for name in TREE:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
        store.pipe_file(f"data/{name}", b"x")
    every = ["loc/a.tar", "loc/sub/img/0.png", "loc/sub/img/0.txt", "loc/sub/t.tar"]
    for pattern, want in (
        ("loc/**", every),
        ("loc/*", ["loc/a.tar"]),
        ("loc/**/*.tar", ["loc/a.tar", "loc/sub/t.tar"]),
        ("loc/*/*.t?r", ["loc/sub/t.tar"]),
        ("loc/sub/.*", ["loc/sub/.b.tar"]),
        ("loc/.tmp/*", ["loc/.tmp/x.tar"]),
    ):
        local = [os.path.relpath(p, tmp_path) for p in _expand(str(tmp_path / pattern))]
        remote = [u.removeprefix("s3://data/") for u in _expand(f"s3://data/{pattern}")]
        assert local == remote == want, pattern


def test_a_folder_is_indexed_once_where_an_input_names_it(tmp_path, caplog):
    """A glob matching files and folders indexes the files, and says so (``loc/**`` once
    indexed ``loc``, ``loc/sub`` and ``loc/sub/img`` again); a glob matching only folders
    stands for them (``parts/part-*``, with or without ``--metadata``); a folder named twice is
    read once."""
    import json

    from entrain_data.workers.index_builder import build_index
    from PIL import Image

    parts = []
    for i in range(2):
        part = tmp_path / "parts" / f"part-{i}"
        part.mkdir(parents=True)
        Image.new("RGB", (8, 6 + i)).save(part / f"{i}.png")
        (part / f"{i}.txt").write_text("a caption")
        rec = {"file_name": f"{i}.png", "caption": "a caption"}
        (part / "captions.jsonl").write_text(json.dumps(rec) + "\n")
        parts.append(str(part))
    table = build_index(str(tmp_path / "parts" / "part-*"), progress=False)
    assert sorted(set(table.sources)) == parts and len(table.keys) == 2
    table = build_index(str(tmp_path / "parts" / "*"), progress=False, metadata="captions.jsonl")
    assert sorted(set(table.sources)) == [f"{p}/captions.jsonl" for p in parts]
    # nested matches: the outermost folder only (it is read with what is under it)
    table = build_index(f"{tmp_path}/parts/**/", progress=False)  # parts, part-0, part-1
    assert list(table.sources) == [str(tmp_path / "parts")] * 2 and len(table.keys) == 2
    (tmp_path / "parts" / "README.md").write_text("two parts")  # beside the folders: not a shard
    table = build_index(str(tmp_path / "parts" / "*"), progress=False)
    assert sorted(set(table.sources)) == parts
    (tmp_path / "parts" / "notes.tar").write_bytes(b"")
    with caplog.at_level("WARNING"):
        found = _expand(str(tmp_path / "parts" / "*"))
    assert found == [str(tmp_path / "parts" / n) for n in ("README.md", "notes.tar")]
    assert "not the folders" in caplog.text and "part-0" in caplog.text
    spelled = [parts[0], f"{parts[0]}/", f"{parts[0]}/../part-0", os.path.relpath(parts[0])]
    table = build_index(spelled, progress=False)
    assert list(table.keys) == ["0"] and list(table.sources) == [parts[0]]


def test_every_input_naming_nothing_is_in_one_error_in_input_order(store, tmp_path):
    """Local and remote, named paths, prefixes and globs: one error, in the order given (a missing
    local path once came first whatever its place, and hid every other)."""
    (tmp_path / "ok.tar").write_bytes(b"x")
    inputs = [
        "s3://data/nope.tar",
        str(tmp_path / "gone.tar"),
        "s3://data/shards/a-000.tar",
        "s3://data/none/",
        str(tmp_path / "ok.tar"),
        str(tmp_path / "x-*.tar"),
        "s3://data/shards/*.zip",
        "s3://data/docs",
    ]
    with pytest.raises(InvalidInput) as err:
        _expand(inputs)
    msg = str(err.value)
    named = ["nope.tar", "gone.tar", "s3://data/none/", "x-*.tar", "*.zip", "s3://data/docs/"]
    at = [msg.find(n) for n in named]
    assert -1 not in at and at == sorted(at), msg
    assert msg.startswith("6 inputs name nothing to index: shard, table or folder not found: s3:")
    assert "a-000.tar" not in msg and "ok.tar" not in msg
    from entrain_data.workers.path_patterns import MAX_NAMED

    with pytest.raises(InvalidInput, match=rf"^{MAX_NAMED + 2} inputs .*; and 2 more$") as err:
        _expand(str(tmp_path / f"m-{{00..{MAX_NAMED + 1}}}.tar"))
    assert f"m-{MAX_NAMED - 1:02d}.tar" in str(err.value) and f"m-{MAX_NAMED}" not in str(err.value)
