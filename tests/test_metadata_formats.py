"""Metadata files as writers leave them: a UTF-8 BOM, CRLF, blank lines, quoted newlines, JSON
Lines named ``.json``, a truncated array, a big LLaVA file (lines found in one pass).

Each record's line (its key, its error messages) and byte offset (where a worker reads it when
serving) checked against the file itself; every record read back by its stored offset.
"""

from __future__ import annotations

import json

import pytest
from entrain_data.workers import metadata_source
from entrain_data.workers.decode import audio_seconds
from entrain_data.workers.index_builder import build_index
from entrain_data.workers.metadata_source import MetadataSource, read_record_at, read_records
from entrain_data.workers.sources import open_source

from entrain_data.errors import InvalidInput, SampleError

BOM = b"\xef\xbb\xbf"


def _image(folder, name: str = "a.png") -> None:
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 10, 10)).save(folder / name)


def _llava(n: int, eol: str = "\n") -> tuple[bytes, list[dict], list[int], list[int]]:
    """A LLaVA-like JSON array (non-ASCII text, ``indent``), its records and where each starts
    (line, byte offset), found by searching the bytes: not by the code under test."""
    recs = [
        {"id": i, "image": "a.png", "conversations": [{"from": "human", "value": f"été {i}\n"}]}
        for i in range(n)
    ]
    data = json.dumps(recs, indent=1, ensure_ascii=False).replace("\n", eol).encode()
    marker = f"{eol} {{".encode()  # indent=1: each record opens on its own line as " {"
    offs, at = [], 0
    for _ in recs:
        at = data.index(marker, at) + len(marker) - 1
        offs.append(at)
    lines = [data.count(b"\n", 0, o) + 1 for o in offs]
    return data, recs, lines, offs


class _CountingStr(str):
    """Text that adds up how many characters ``count`` scans: one pass, not one per record."""

    scanned = 0

    def count(self, sub, start=0, end=None):  # type: ignore[override]
        stop = len(self) if end is None else end
        _CountingStr.scanned += max(0, stop - start)
        return super().count(sub, start, end)


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_json_array_lines_and_offsets_are_those_of_the_file(tmp_path, eol):
    data, recs, lines, offs = _llava(40, eol)
    path = tmp_path / "llava.json"
    path.write_bytes(data)
    got = read_records(str(path))
    assert [(line, off) for line, off, _ in got] == list(zip(lines, offs))
    assert [r for *_, r in got] == recs
    assert [read_record_at(str(path), o) for o in offs] == recs  # as a worker reads them


def test_json_line_numbers_take_one_pass_over_the_file():
    """Counting newlines from the file start for every record took 84 s for a 40k-record
    LLaVA file (6 s for json.loads): the characters scanned must stay about the file's size."""
    data, _recs, lines, _offs = _llava(2000)
    text = _CountingStr(data.decode())
    _CountingStr.scanned = 0
    got = metadata_source._json_records(text)
    assert [line for line, _o, _r in got] == lines
    assert _CountingStr.scanned <= len(text)


def test_bad_record_of_a_big_json_array_names_its_line(tmp_path):
    _data, recs, lines, _offs = _llava(300)
    recs[250]["image"] = 7
    body = json.dumps(recs, indent=1, ensure_ascii=False)
    _image(tmp_path)
    (tmp_path / "llava.json").write_text(body)
    with pytest.raises(SampleError, match=rf"llava.json:{lines[250]}: field 'image' item 0"):
        build_index(str(tmp_path / "llava.json"), progress=False)


def _served(index_table) -> list[dict[str, bytes]]:
    """Every sample read back as ``serve`` reads it: the record at its stored offset."""
    t = index_table
    src = open_source(str(t.sources[0]), metadata_columns=t.column_map)
    return [src.read(str(m)) for m in t.members]


def test_bom_csv_keeps_its_first_column(tmp_path):
    """Excel's "CSV UTF-8": the header read as ``\\ufefffile_name`` dropped every image."""
    _image(tmp_path)
    (tmp_path / "metadata.csv").write_bytes(BOM + b"file_name,text\na.png,hello\n")
    t = build_index(str(tmp_path), progress=False)
    assert t.column_map == {"text": "text", "media": "file_name"}
    assert [len(r.images) for r in t] == [1] and list(t.keys) == ["metadata.csv:2"]
    assert _served(t)[0]["txt"] == b"hello"


@pytest.mark.parametrize("name", ["llava.json", "meta.jsonl"])
def test_bom_json_records_are_read_and_served_at_their_offsets(tmp_path, name):
    _image(tmp_path)
    recs = [
        {"image": "a.png", "conversations": [{"from": "human", "value": f"é{i}"}]} for i in (0, 1)
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in recs]
    body = "[\n" + ",\n".join(lines) + "\n]\n" if name.endswith(".json") else "\n".join(lines)
    (tmp_path / name).write_bytes(BOM + body.encode())
    t = build_index(str(tmp_path / name), progress=False)
    first = 2 if name.endswith(".json") else 1
    assert list(t.keys) == [f"{name}:{first}", f"{name}:{first + 1}"]
    assert [len(r.images) for r in t] == [1, 1]
    served = _served(t)
    assert [json.loads(s["json"]) for s in served] == [r["conversations"] for r in recs]
    raw = (tmp_path / name).read_bytes()
    for m, rec in zip(t.members, recs):  # the stored offset is where the record's bytes start
        off = int(str(m).rpartition(":")[2])
        assert raw[off:].startswith(json.dumps(rec, ensure_ascii=False).encode())


def test_csv_lines_count_blank_lines_quoted_newlines_and_crlf(tmp_path):
    """Rows were numbered by position: a blank line or a quoted caption over two lines put the
    key and the errors of every later row on the wrong line."""
    body = 'file_name,text\r\na.png,one\r\n\r\na.png,"two\r\nlines"\r\nnope.png,three\r\n\r\n'
    (tmp_path / "metadata.csv").write_bytes(body.encode())
    _image(tmp_path)
    src = MetadataSource(tmp_path / "metadata.csv")
    members = src.keys()  # noqa: SIM118 - a source, not a dict
    assert [src.key(m) for m in members] == [f"metadata.csv:{n}" for n in (2, 4, 6)]
    assert src.read(members[1])["txt"] == b"two\r\nlines"
    with pytest.raises(SampleError, match=r"metadata.csv:6: cannot read .*nope.png"):
        build_index(str(tmp_path), progress=False)


def test_csv_short_and_long_rows_as_dictreader(tmp_path):
    (tmp_path / "metadata.csv").write_text("file_name,text,id\na.png,x\na.png,y,7,extra\n")
    assert [r for *_, r in read_records(str(tmp_path / "metadata.csv"))] == [
        {"file_name": "a.png", "text": "x", "id": None},
        {"file_name": "a.png", "text": "y", "id": "7", None: ["extra"]},
    ]


def test_a_csv_field_over_the_csv_limit_is_named_not_a_traceback(tmp_path):
    (tmp_path / "metadata.csv").write_text("file_name,text\na.png,ok\na.png," + "x" * 200_000)
    with pytest.raises(InvalidInput, match=r"metadata.csv:3: cannot read the CSV row \(field"):
        read_records(str(tmp_path / "metadata.csv"))


def test_json_lines_in_a_json_file_are_every_record(tmp_path):
    """``to_json(orient="records", lines=True)`` saved as ``.json``: only the first record was
    read, silently."""
    _image(tmp_path)
    recs = [{"file_name": "a.png", "text": f"t{i}"} for i in range(3)]
    (tmp_path / "data.json").write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = build_index(str(tmp_path / "data.json"), progress=False)
    assert list(t.keys) == ["data.json:1", "data.json:2", "data.json:3"]
    assert [s["txt"] for s in _served(t)] == [b"t0", b"t1", b"t2"]


@pytest.mark.parametrize(
    "body, needle",
    [
        (
            '[{"text": "a"},\n{"text": "b"},\n',
            r"x.json:3: not valid JSON \(the array is not closed",
        ),
        ('[{"text": "a"}\n{"text": "b"}]', r"x.json:2: not valid JSON \(Expecting ',' delimiter"),
        (
            '[{"text": "a"}]\n[{"text": "b"}]\n',
            r"x.json:2: not valid JSON \(text after the array's closing ']'",
        ),
    ],
)
def test_a_truncated_or_broken_array_is_refused(tmp_path, body, needle):
    """Cut between two records (a partial download), the array read as a silent subset; two
    arrays one after the other (files concatenated) read as the first one alone."""
    (tmp_path / "x.json").write_text(body)
    with pytest.raises(InvalidInput, match=needle):
        read_records(str(tmp_path / "x.json"))


def test_metadata_not_in_utf8_says_so(tmp_path):
    (tmp_path / "metadata.csv").write_bytes("file_name,text\na.png,café\n".encode("cp1252"))
    with pytest.raises(InvalidInput, match=r"metadata.csv: cannot read .*save it as UTF-8"):
        read_records(str(tmp_path / "metadata.csv"))


def test_unreadable_media_errors_do_not_print_a_buffer(tmp_path):
    """``cannot identify image file <_io.BytesIO object at 0x7f...>``: the record's line says
    which file; the buffer's address says nothing."""
    (tmp_path / "bad.png").write_bytes(b"not an image")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "bad.png", "text": "x"}))
    with pytest.raises(SampleError, match=r"metadata.jsonl:1: not a readable image") as err:
        build_index(str(tmp_path), progress=False)
    assert "BytesIO" not in str(err.value)
    with pytest.raises(ValueError, match="not a readable audio file") as err:
        audio_seconds(b"not audio")
    assert "BytesIO" not in str(err.value)
    from entrain_data.workers.decode import decode_audio, decode_image  # at serve time too

    for decode, what in ((decode_image, "image"), (decode_audio, "audio")):
        with pytest.raises(ValueError, match=f"{what} does not decode") as err:
            decode(b"not media")
        assert "BytesIO" not in str(err.value)


def test_bom_metadata_in_object_storage_is_read_and_served_as_locally(tmp_path):
    """The same readers over S3 (moto's server): the whole file at index, one ranged GET per
    record when serving, at offsets that count the BOM."""
    s3fs = pytest.importorskip("s3fs", reason="s3fs (test extra) not installed")
    pytest.importorskip("moto.server", reason="moto[server] (test extra) not installed")
    from _s3 import s3_server

    _image(tmp_path)
    recs = [
        {"image": "a.png", "conversations": [{"from": "human", "value": f"é{i}"}]} for i in (0, 1)
    ]
    (tmp_path / "llava.json").write_bytes(BOM + json.dumps(recs, indent=1).encode())
    (tmp_path / "metadata.csv").write_bytes(BOM + b"file_name,text\na.png,hello\n")
    with s3_server():
        fs = s3fs.S3FileSystem()
        fs.mkdir("data")
        fs.put(str(tmp_path), "data/ds", recursive=True)
        t = build_index("s3://data/ds/llava.json", progress=False)
        assert [len(r.images) for r in t] == [1, 1]
        served = _served(t)
        assert [json.loads(s["json"]) for s in served] == [r["conversations"] for r in recs]
        t = build_index("s3://data/ds", metadata="metadata.csv", progress=False)
        assert [len(r.images) for r in t] == [1] and _served(t)[0]["txt"] == b"hello"
