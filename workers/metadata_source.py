"""Media files named by a metadata file: Hugging Face ``ImageFolder``/``AudioFolder`` and LLaVA.

Two layouts users keep, read the same way:

- ``ImageFolder``: ``metadata.jsonl`` / ``metadata.csv`` / ``metadata.parquet`` beside the files,
  one record per sample, ``file_name`` naming the media file, other columns features.
- LLaVA / LLaMA-Factory ShareGPT: one ``.json`` (a list) or ``.jsonl`` of records with a
  conversation (``conversations`` / ``messages``) and ``image`` / ``images`` / ``audios`` /
  ``videos`` naming the media files (a string or a list).

A record becomes a WebDataset-like sample, so the index and the packer treat it as a tar
sample: the text as ``txt`` (a string) or ``json`` (a conversation, as the packer parses it),
media files as ``image000.jpg``, ``video000.mp4``, ``audio000.wav``... (their own suffix, so the
kind follows the file; paths relative to the metadata file's folder). The metadata file and its
media may live in object storage (``s3://bucket/llava.json``, :mod:`.storage`): the file is read
whole at index time, one record by byte range when serving.

``columns`` maps roles to record fields: ``text`` (default: the first of ``messages``,
``conversations``, ``text``, ``caption``, ``captions`` present), ``media`` (kind from each
file's suffix; default ``file_name``), ``image`` / ``audio`` / ``video`` (defaults: ``image`` or
``images``, ``audio`` or ``audios``, ``video`` or ``videos``), ``key`` (default
``"<metadata file name>:<line>"``, the line where the record starts; Parquet: its row
number from 1).

A list of strings as text (COCO's five captions) is one sample with the *first* caption by
default: one image decode per record and a deterministic epoch, priced exactly. With
``captions="each"`` every caption is its own sample (member ``"<record>#<i>"``), for training that
should see all of them (the image is decoded once per caption).
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from entrain_data.errors import InvalidInput, SampleError

from . import storage
from .decode import member_kind

__all__ = ["METADATA_NAMES", "MetadataSource", "is_metadata_file", "member_line", "resolve_columns"]

METADATA_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
"""File names a folder is read through (the ``ImageFolder`` convention), in this order."""

_SUFFIXES = (".json", ".jsonl", ".csv")
_TEXT_FIELDS = ("messages", "conversations", "text", "caption", "captions")
_MEDIA_FIELDS = {
    "media": ("file_name",),
    "image": ("image", "images"),
    "audio": ("audio", "audios"),
    "video": ("video", "videos"),
}
_DEFAULT_EXT = {"image": "png", "audio": "wav", "video": "mp4"}
_WS = re.compile(r"[ \t\r\n]*")  # JSON's whitespace
_BOM = codecs.BOM_UTF8
"""Excel's "CSV UTF-8" and some JSON writers start the file with it: not part of the first
field name (a BOM CSV lost every image) nor of the JSON."""


def is_metadata_file(path: str) -> bool:
    """A ``.json`` / ``.jsonl`` / ``.csv`` file, or a Parquet file named ``metadata.parquet``."""
    return path.endswith(_SUFFIXES) or os.path.basename(path) == "metadata.parquet"


Record = tuple[int, int, Any]
"""(line where the record starts, its byte offset or -1, the record)."""


def _json_records(text: str, base: int = 0) -> list[Record]:
    """Records of a JSON array, or of objects one after another (one object; JSON Lines in a
    ``.json`` file, which read as one record before), with the line and byte offset of each.
    ``base``: bytes before ``text`` in the file (a BOM)."""
    dec = json.JSONDecoder()
    ascii_only = text.isascii()
    at, byte, line = 0, base, 1  # text[at]: at byte ``byte``, on line ``line``

    def where(i: int) -> tuple[int, int]:
        """From the previous record on, not the file start: the file is scanned once (counting
        from the start per record took 84 s for a 40k-record LLaVA file)."""
        nonlocal at, byte, line
        line += text.count("\n", at, i)
        byte += i - at if ascii_only else len(text[at:i].encode("utf-8"))
        at = i
        return line, byte

    out: list[Record] = []
    i = _WS.match(text).end()
    array = text.startswith("[", i)
    i += array
    while True:
        i = _WS.match(text, i).end()
        if i >= len(text) or (array and text[i] == "]"):
            if array and i >= len(text):  # cut at a record boundary: not a silent subset
                raise json.JSONDecodeError("the array is not closed (a truncated file?)", text, i)
            end = _WS.match(text, i + 1).end() if array else i
            if end < len(text):  # records after the array were dropped unread
                raise json.JSONDecodeError("text after the array's closing ']'", text, end)
            return out
        line_off = where(i)
        obj, i = dec.raw_decode(text, i)
        out.append((*line_off, obj))
        i = _WS.match(text, i).end()
        if array and text.startswith(",", i):
            i += 1
        elif array and not text.startswith("]", i) and i < len(text):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _open_bytes(path: str) -> io.BufferedIOBase:
    """A local file, or an object in storage fetched in one GET (the file is parsed whole)."""
    if storage.is_remote(path):
        return io.BytesIO(storage.read_all(path))
    return open(path, "rb")  # noqa: SIM115 - the caller closes it


def _jsonl_records(path: str) -> list[Record]:
    out: list[Record] = []
    off = 0
    with _open_bytes(path) as f:
        for n, raw in enumerate(f, 1):
            if n == 1 and raw.startswith(_BOM):  # offsets count it; a BOM-only line is blank
                raw, off = raw[len(_BOM) :], len(_BOM)
            if raw.strip():
                try:
                    out.append((n, off, json.loads(raw)))
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    msg = getattr(exc, "msg", str(exc))
                    raise InvalidInput(f"{path}:{n}: not valid JSON ({msg})") from exc
            off += len(raw)
    return out


def _csv_records(path: str, f: io.TextIOBase) -> list[Record]:
    """Rows as ``csv.DictReader`` makes them, each with the line it starts on: ``DictReader``
    skips blank lines and a quoted field may span lines, so counting rows misplaced both."""
    rows = csv.reader(f)
    out: list[Record] = []
    try:
        header = next(rows, [])
        start = rows.line_num + 1
        for row in rows:
            if row:
                rec: dict[str | None, Any] = dict(zip(header, row))
                if len(row) > len(header):  # as DictReader: extra fields under None, missing None
                    rec[None] = row[len(header) :]
                rec.update(dict.fromkeys(header[len(row) :]))
                out.append((start, -1, rec))
            start = rows.line_num + 1
    except csv.Error as exc:  # a caption over 128 KiB: not a traceback
        raise InvalidInput(f"{path}:{rows.line_num}: cannot read the CSV row ({exc})") from exc
    return out


def read_records(path: str) -> list[Record]:
    """Every record of a metadata file (see :data:`Record`); InvalidInput names file:line."""
    try:
        if path.endswith(".parquet"):
            rows = storage.open_parquet(path).read().to_pylist()  # "line": row number, from 1
            return [(i + 1, -1, r) for i, r in enumerate(rows)]
        if path.endswith(".jsonl"):
            return _jsonl_records(path)
        with _open_bytes(path) as f:
            if path.endswith(".csv"):
                return _csv_records(path, io.TextIOWrapper(f, encoding="utf-8-sig", newline=""))
            raw = f.read()
        base = len(_BOM) if raw.startswith(_BOM) else 0
        text = raw.decode("utf-8-sig")
        del raw
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, InvalidInput):
            raise
        hint = "; save it as UTF-8" if isinstance(exc, UnicodeDecodeError) else ""
        raise InvalidInput(f"{path}: cannot read metadata file ({exc}){hint}") from exc
    try:
        return _json_records(text, base)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc


def read_record_at(path: str, offset: int) -> Any:
    """One JSON record starting at byte ``offset`` (a JSONL line or an element of a JSON array):
    what a worker reads, instead of parsing the whole file (LLaVA's is ~1 GB). One ranged read
    of 64 KiB (a GET in object storage), doubled until the record is whole."""
    size = 1 << 16
    while True:
        buf = storage.read_range(path, offset, offset + size)
        if path.endswith(".jsonl"):
            nl = buf.find(b"\n")
            if nl >= 0 or len(buf) < size:
                return json.loads(buf if nl < 0 else buf[:nl])
        else:
            try:
                return json.JSONDecoder().raw_decode(buf.decode("utf-8", errors="ignore"))[0]
            except json.JSONDecodeError:
                if len(buf) < size:
                    raise
        size *= 2


def resolve_columns(
    path: str, records: Sequence[tuple[int, Any]], columns: Mapping[str, str] | None
) -> dict[str, str]:
    """The mapping given, completed by the defaults (module doc) from the fields of *every*
    record: a LLaVA mix whose first records are text-only still names its images."""
    cols = dict(columns or {})
    if not records:
        raise InvalidInput(f"{path}: metadata file has no records")
    line, _off, first = records[0]
    if not isinstance(first, Mapping):
        raise InvalidInput(f"{path}:{line}: record is a {type(first).__name__}, not an object")
    unknown = sorted(set(cols) - {"text", "key", *_MEDIA_FIELDS})
    if unknown:
        raise InvalidInput(
            f"{path}: unknown role {unknown[0]!r} in the column mapping (roles: text, key, "
            "media, image, audio, video)"
        )
    fields: Counter[str] = Counter()  # in how many records each field appears
    for _line, _o, obj in records:
        if isinstance(obj, Mapping):
            fields.update(obj.keys())

    def most_common(names: Sequence[str]) -> str | None:
        """The name most records hold (ties: the first of ``names``): one stray record with
        ``messages`` in a file of ``conversations`` does not re-map the file."""
        found = [f for f in names if fields[f]]
        return max(found, key=lambda f: fields[f]) if found else None

    if "text" not in cols:
        text = most_common(_TEXT_FIELDS)
        if text is None:
            raise InvalidInput(
                f"{path}: no record has a text field ({', '.join(_TEXT_FIELDS)}); map one "
                "with --column text=FIELD"
            )
        cols["text"] = text
    if not set(cols) & set(_MEDIA_FIELDS):
        for role, names in _MEDIA_FIELDS.items():
            name = most_common(names)
            if name is not None:
                cols[role] = name
    for role, name in cols.items():
        if name not in fields:
            raise InvalidInput(f"{path}: field {name!r} (for {role!r}) is in no record")
    return cols


class MetadataSource:
    """The records of one metadata file as samples (module doc).

    Members are ``"<record>"`` or, where the file allows seeking (JSON, JSONL),
    ``"<record>@<line>:<byte offset>"``, plus ``"#<caption>"`` under ``captions="each"``. With
    ``lazy`` (serving: ``columns`` is the mapping resolved at index time) the file is not parsed
    at open; each record is read at its offset when asked for.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        columns: Mapping[str, str] | None = None,
        captions: str = "",
        *,
        lazy: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.root = (
            self.path.rsplit("/", 1)[0]
            if storage.is_remote(self.path)
            else os.path.dirname(os.path.abspath(self.path))
        )
        self._records: list[Record] | None = None
        if lazy and columns and "text" in columns:
            self.columns = dict(columns)
        else:
            self._records = read_records(self.path)
            self.columns = resolve_columns(self.path, self._records, columns)
        if captions not in ("", "first", "each"):
            raise InvalidInput(f"captions must be 'first' or 'each', got {captions!r}")
        self.captions = captions or "first"

    def _load(self, rec: int, where: str) -> tuple[int, Any]:
        if where and self._records is None:  # serving: read the one record at its offset
            line, _, off = where.partition(":")
            try:
                return int(line), read_record_at(self.path, int(off))
            except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
                raise SampleError(
                    f"{self.path}:{line}: cannot read the record at byte {off} ({exc}; "
                    "file changed since indexing?)",
                    source=self.path,
                    key=str(rec),
                ) from exc
        if self._records is None:
            self._records = read_records(self.path)
        line, _off, obj = self._records[rec]
        return line, obj

    def _record(self, member: str) -> tuple[int, Mapping[str, Any], int | None]:
        head, _, cap = member.partition("#")
        rec, _, where = head.partition("@")
        try:
            line, obj = self._load(int(rec), where)
        except (ValueError, IndexError):
            raise SampleError(
                f"{self.path}: no record {member!r} (stale index?)", source=self.path, key=member
            ) from None
        if not isinstance(obj, Mapping):
            raise SampleError(
                f"{self.path}:{line}: record is a {type(obj).__name__}, not an object",
                source=self.path,
                key=member,
            )
        return line, obj, int(cap) if cap else None

    def line(self, member: str) -> int:
        """The line of the metadata file where the record of ``member`` starts (0 if none)."""
        try:
            at = member_line(member)  # a CSV record names no line: its record's is loaded
            return at if at is not None else self._load(int(member.partition("#")[0]), "")[0]
        except (ValueError, IndexError):
            return 0

    def keys(self) -> list[str]:
        """Every member (class doc), in file order."""
        if self._records is None:
            self._records = read_records(self.path)
        out = []
        field = self.columns["text"]
        for i, (line, off, obj) in enumerate(self._records):
            v = obj.get(field) if isinstance(obj, Mapping) else None
            m = f"{i}@{line}:{off}" if off >= 0 else str(i)
            if self.captions == "each" and _is_captions(v):
                out.extend(f"{m}#{j}" for j in range(len(v)))
            else:
                out.append(m)
        return out

    def key(self, member: str) -> str:
        """The sample's key: the ``key`` field, else ``"<file name>:<line>"`` (+ ``#caption``)."""
        line, obj, cap = self._record(member)
        base = (
            str(obj[self.columns["key"]])
            if "key" in self.columns and obj.get(self.columns["key"]) is not None
            else f"{os.path.basename(self.path)}:{line}"
        )
        return base if cap is None else f"{base}#{cap}"

    def _files(self, line: int, obj: Mapping[str, Any]) -> dict[str, str]:
        files: dict[str, str] = {}
        for role in _MEDIA_FIELDS:
            if role not in self.columns:
                continue
            v = obj.get(self.columns[role])
            items = v if isinstance(v, (list, tuple)) else ([] if v in (None, "") else [v])
            for i, name in enumerate(items):
                if not isinstance(name, str):
                    raise ValueError(
                        f"field {self.columns[role]!r} item {i} is a {type(name).__name__}, "
                        "not a file name"
                    )
                suffix = os.path.splitext(name)[1].lower().lstrip(".")
                kind = member_kind(suffix)
                if role == "media" and kind not in ("image", "audio", "video"):
                    raise ValueError(f"{name}: not an image, audio or video file by its suffix")
                kind = kind if role == "media" else role
                ext = suffix if member_kind(suffix) == kind else _DEFAULT_EXT[kind]
                files[f"{kind}{len(files):03d}.{ext}"] = os.path.join(self.root, name)
        return files

    def members(self, member: str) -> dict[str, str]:
        """Extensions of one sample: ``txt`` or ``json`` and its media (file path of each)."""
        line, obj, _cap = self._record(member)
        try:
            out = {"text": self.columns["text"], **self._files(line, obj)}
        except ValueError as exc:
            raise SampleError(f"{self.path}:{line}: {exc}", source=self.path, key=member) from exc
        v = obj.get(self.columns["text"])
        out["txt" if isinstance(v, str) or _is_captions(v) else "json"] = out.pop("text")
        return out

    def read(
        self,
        member: str,
        exts: Sequence[str] | None = None,
        limit: int | Mapping[str, int] | None = None,
    ) -> dict[str, bytes]:
        """Member bytes by extension (at most ``limit`` bytes of each, or of those it names)."""
        line, obj, cap = self._record(member)
        out: dict[str, bytes] = {}
        for ext, ref in self.members(member).items():
            if exts is not None and ext not in exts:
                continue
            if ext in ("txt", "json"):
                out[ext] = self._text(line, obj, cap, member)
                continue
            n = limit if isinstance(limit, int) else (limit or {}).get(ext)
            try:
                out[ext] = storage.read_all(ref) if n is None else storage.read_range(ref, 0, n)
            except OSError as exc:
                raise SampleError(
                    f"{self.path}:{line}: cannot read {ref} ({exc.strerror or exc})"
                    + self._hint(obj, ref),
                    source=self.path,
                    key=member,
                ) from exc
        return out

    def _hint(self, obj: Mapping[str, Any], missing: str) -> str:
        """Another field of the record naming an existing file of that name, to map instead."""
        base = os.path.basename(missing)
        for field, v in obj.items():
            if (
                isinstance(v, str)
                and field not in self.columns.values()
                and os.path.basename(v) == base
                and _exists(os.path.join(self.root, v))
            ):
                return f"; field {field!r} names an existing file: --column media={field}"
        return ""

    def _text(self, line: int, obj: Mapping[str, Any], cap: int | None, member: str) -> bytes:
        field = self.columns["text"]
        v = obj.get(field)
        if _is_captions(v):
            if not v or (cap is not None and cap >= len(v)):
                raise SampleError(
                    f"{self.path}:{line}: field {field!r} has no caption {cap or 0}",
                    source=self.path,
                    key=member,
                )
            return str(v[cap or 0]).encode("utf-8")
        if isinstance(v, str):
            return v.encode("utf-8")
        if isinstance(v, (list, dict)):
            return json.dumps(v).encode("utf-8")
        raise SampleError(
            f"{self.path}:{line}: field {field!r} is {type(v).__name__}, not text or a conversation",
            source=self.path,
            key=member,
        )

    def close(self) -> None:
        pass


def member_line(member: str) -> int | None:
    """The line a member names (``<record>@<line>:<byte offset>[#caption]``), None where it
    names none (a CSV record is ``<record>[#caption]``); ValueError where it is malformed."""
    where = member.partition("#")[0].partition("@")[2]
    return int(where.partition(":")[0]) if where else None


def _exists(path: str) -> bool:
    """For a hint only: a storage failure means no hint, not a second error."""
    try:
        return storage.is_file(path)
    except InvalidInput:
        return False


def _is_captions(v: Any) -> bool:
    """A list of strings (several captions), as opposed to a conversation (a list of turns)."""
    return isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)
