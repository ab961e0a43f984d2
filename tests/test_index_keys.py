"""Sample keys as the user gave them or as the README documents them, and the column mapping's
roles checked: a repeated user key is refused naming both records, never renamed; keys the
index makes stay ``FILE:LINE``; a misspelt Parquet role is refused by name."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from entrain_data.workers.index_builder import build_index

from entrain_data.cli import main
from entrain_data.errors import InvalidInput


def _coco_metadata(folder, shared_data, ids: list[str]):
    """A metadata.jsonl of coco_mini images, one record per id (absolute image paths)."""
    rows = [json.loads(x) for x in (shared_data / "coco_mini" / "captions.jsonl").open()]
    folder.mkdir(parents=True, exist_ok=True)
    recs = [
        {"id": i, "file_name": str(shared_data / "coco_mini" / r["path"]), "text": r["captions"][0]}
        for i, r in zip(ids, rows)
    ]
    path = folder / "metadata.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_a_repeated_key_field_is_refused_naming_both_records(tmp_path, shared_data, capsys):
    """It was accepted (rc 0) and every key replaced by an internal id (``metadata.jsonl:0@1:0``)."""
    meta = _coco_metadata(tmp_path / "m", shared_data, ["a", "dup", "b", "dup", "c"])
    out = tmp_path / "i.parquet"
    assert main(["index", str(meta), "--column", "key=id", "-q", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"duplicate key 'dup' in column 'id': {meta}:2 and {meta}:4" in err, err
    assert not out.exists()
    # across two files too: the same id in two folders
    meta = _coco_metadata(tmp_path / "m", shared_data, ["a", "b"])
    other = _coco_metadata(tmp_path / "n", shared_data, ["x", "a"])
    with pytest.raises(
        InvalidInput, match=rf"duplicate key 'a' in column 'id': {meta}:1 and {other}:2"
    ):
        build_index([str(meta), str(other)], progress=False, parquet_columns={"key": "id"})


def test_unique_key_field_is_kept_as_given(tmp_path, shared_data):
    meta = _coco_metadata(tmp_path / "m", shared_data, ["a", "b", "c"])
    t = build_index(str(meta), progress=False, parquet_columns={"key": "id"})
    assert list(t.keys) == ["a", "b", "c"]


def test_made_metadata_keys_are_file_and_line_as_documented(tmp_path, shared_data):
    """Two folders each with a metadata.jsonl gave ``a/metadata.jsonl:0@1:0``: README says
    ``FILE:LINE``."""
    for sub in ("a", "b"):
        _coco_metadata(tmp_path / "two" / sub, shared_data, ["x", "y"])
    t = build_index([str(tmp_path / "two" / "a"), str(tmp_path / "two" / "b")], progress=False)
    assert list(t.keys) == [
        "a/metadata.jsonl:1",
        "a/metadata.jsonl:2",
        "b/metadata.jsonl:1",
        "b/metadata.jsonl:2",
    ]
    one = build_index(str(tmp_path / "two" / "a"), progress=False)
    assert list(one.keys) == ["metadata.jsonl:1", "metadata.jsonl:2"]


def test_parquet_duplicate_key_names_the_users_column_and_rows(tmp_path):
    """It said ``in column 'key'`` when the user's column was ``id``."""
    path = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "a"], "text": ["x", "y", "z"]}), path)
    with pytest.raises(
        InvalidInput, match=rf"duplicate key 'a' in column 'id': {path} row 0 and {path} row 2"
    ):
        build_index(str(path), progress=False, parquet_columns={"key": "id"})


def test_null_parquet_keys_fall_back_to_table_and_row(tmp_path):
    """A null in the key column read as the key ``'None'``, so a second null was refused as a
    duplicate of the first. Now a null key falls back to the key the index makes
    (``TABLE:ROW``), as a null metadata key falls back to ``FILE:LINE``; the others stay the
    user's."""
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"id": ["a", None, "b", None], "text": ["w", "x", "y", "z"]}), path)
    t = build_index(str(path), progress=False, parquet_columns={"key": "id"})
    assert list(t.keys) == ["a", "nulls.parquet:1", "b", "nulls.parquet:3"]


def test_a_user_key_spelt_like_a_made_one_is_refused_naming_both_records(tmp_path):
    """A given key equal to the key the index makes for a null one (``t.parquet:1``) was
    refused only by the table's check, which named neither record ("2 rows"); now the error
    names both, in a table and in a metadata file."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["t.parquet:1", None], "text": ["x", "y"]}), path)
    with pytest.raises(InvalidInput, match=r"'t.parquet:1'.*t.parquet row 0.*t.parquet row 1"):
        build_index(str(path), progress=False, parquet_columns={"key": "id"})
    meta = tmp_path / "m.jsonl"
    rows = [{"id": None, "text": "x"}, {"id": "m.jsonl:1", "text": "y"}]
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InvalidInput, match=r"'m.jsonl:1'.*m.jsonl:1 and .*m.jsonl:2"):
        build_index(str(meta), progress=False, parquet_columns={"key": "id", "text": "text"})


def test_misspelt_parquet_role_is_refused_by_name(tmp_path, capsys):
    """``--column audio_secs=dur`` was stored and silently read as no audio (rc 0)."""
    path = tmp_path / "dur.parquet"
    pq.write_table(pa.table({"caption": ["x", "y"], "dur": [1.0, 2.0]}), path)
    out = tmp_path / "i.parquet"
    argv = ["index", str(path), "--column", "text=caption", "--column", "audio_secs=dur"]
    assert main([*argv, "-q", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown role 'audio_secs'" in err and "audio_seconds" in err and not out.exists()
    assert main(["index", str(path), "-q", "-o", str(out)]) == 2  # no text column
    err = capsys.readouterr().err
    assert "--column text=COLUMN" in err and "parquet_columns" not in err
