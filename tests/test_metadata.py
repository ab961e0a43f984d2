"""Sample metadata index: validation on read names the column or key; round trip; take/concat."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from entrain_data.errors import InvalidInput
from entrain_data.metadata import (
    INDEX_SCHEMA,
    SampleMeta,
    SampleTable,
    VisionItem,
    read_index,
    write_index,
)


def records():
    return [
        SampleMeta("a", "shard-0.tar", 12, images=(VisionItem(1, 480, 640),), member="a"),
        SampleMeta("b", "shard-0.tar", 0, audio_seconds=(3.5, 1.25), member="b"),
        SampleMeta("c", "t.parquet", 700, row=4),
        SampleMeta(
            "d",
            "shard-1.tar",
            33,
            images=(VisionItem(16, 360, 640), VisionItem(1, 7016, 4961)),
            audio_seconds=(30.0,),
            member="d",
        ),
    ]


@pytest.fixture
def table():
    return SampleTable.from_records(records(), origin="test")


def _write(tmp_path, arrow_table, name="idx.parquet"):
    p = tmp_path / name
    pq.write_table(arrow_table, p)
    return p


def test_round_trip_keeps_every_field(table, tmp_path):
    back = read_index(write_index(table, tmp_path / "i.parquet"))
    assert [r for r in back] == records()
    assert back.to_arrow().schema.equals(INDEX_SCHEMA, check_metadata=False)
    assert list(back.image_counts) == [1, 0, 0, 2] and list(back.audio_counts) == [0, 2, 0, 1]


def test_take_and_concat(table):
    t = table.take([3, 0])
    assert [r.key for r in t] == ["d", "a"]
    assert t.record(0) == records()[3] and t.record(1) == records()[0]
    assert list(t.image_sample_ids()) == [0, 0, 1]
    empty = table.take([])
    assert len(empty) == 0 and len(empty.image_frames) == 0
    other = SampleTable.from_records([SampleMeta("e", "s", 1, audio_seconds=(2.0,))])
    both = SampleTable.concat([table, other])
    assert [r for r in both] == records() + [other.record(0)]
    with pytest.raises(InvalidInput, match="duplicate key 'a'"):
        SampleTable.concat([table, table.take([0])])
    with pytest.raises(InvalidInput, match="out of range"):
        table.take([4])


def test_missing_column_is_named(table, tmp_path):
    p = _write(tmp_path, table.to_arrow().drop_columns(["audio_seconds"]))
    with pytest.raises(InvalidInput, match="missing column.*'audio_seconds'"):
        read_index(p)


def test_wrong_type_is_named(table, tmp_path):
    t = table.to_arrow()
    i = t.schema.get_field_index("text_tokens")
    t = t.set_column(i, "text_tokens", pa.array(["x"] * len(t)))
    with pytest.raises(InvalidInput, match="'text_tokens'"):
        read_index(_write(tmp_path, t))
    t = table.to_arrow()
    i = t.schema.get_field_index("image_height")
    t = t.set_column(i, "image_height", pa.array(["tall"] * len(t)))
    with pytest.raises(InvalidInput, match="'image_height'"):
        read_index(_write(tmp_path, t, "b.parquet"))


@pytest.mark.parametrize(
    "column,value,needle",
    [
        ("text_tokens", pa.array([12, -1, 700, 33], type=pa.int32()), "'text_tokens'.*'b'"),
        (
            "image_width",
            pa.array([[640], [], [], [-640, 4961]], type=pa.list_(pa.int32())),
            "'image_width'.*'d'",
        ),
        (
            "audio_seconds",
            pa.array([[], [3.5, -1.0], [], [30.0]], type=pa.list_(pa.float32())),
            "'audio_seconds'.*'b'",
        ),
        (
            "image_frames",
            pa.array([[0], [], [], [16, 1]], type=pa.list_(pa.int32())),
            "'image_frames'.*'a'",
        ),
    ],
)
def test_negative_sizes_name_column_and_key(table, tmp_path, column, value, needle):
    t = table.to_arrow()
    t = t.set_column(t.schema.get_field_index(column), column, value)
    with pytest.raises(InvalidInput, match=needle):
        read_index(_write(tmp_path, t))


def test_duplicate_keys_are_named(table, tmp_path):
    t = table.to_arrow()
    t = t.set_column(0, "key", pa.array(["a", "b", "a", "d"]))
    with pytest.raises(InvalidInput, match="duplicate key 'a'"):
        read_index(_write(tmp_path, t))


def test_nulls_and_mismatched_item_lists_are_named(table, tmp_path):
    t = table.to_arrow()
    t = t.set_column(0, "key", pa.array(["a", None, "c", "d"]))
    with pytest.raises(InvalidInput, match="'key'"):
        read_index(_write(tmp_path, t))
    t = table.to_arrow()
    i = t.schema.get_field_index("image_height")
    t = t.set_column(i, "image_height", pa.array([[480], [], [], [360]], type=pa.list_(pa.int32())))
    with pytest.raises(InvalidInput, match="image_frames.*image_height"):
        read_index(_write(tmp_path, t, "m.parquet"))


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(InvalidInput, match="not found"):
        read_index(tmp_path / "none.parquet")
    p = tmp_path / "junk.parquet"
    p.write_bytes(b"PAR1 nothing")
    with pytest.raises(InvalidInput, match="junk.parquet"):
        read_index(p)


def test_record_validation():
    with pytest.raises(InvalidInput, match="key"):
        SampleMeta("", "s", 1)
    with pytest.raises(InvalidInput, match="text_tokens"):
        SampleMeta("k", "s", -1)
    with pytest.raises(InvalidInput):
        VisionItem(1, 0, 10)
    with pytest.raises(InvalidInput, match="audio_seconds"):
        SampleMeta("k", "s", 1, audio_seconds=(float("nan"),))


def test_empty_table_round_trips(tmp_path):
    t = SampleTable.from_records([])
    back = read_index(write_index(t, tmp_path / "e.parquet"))
    assert len(back) == 0 and np.array_equal(back.image_offsets, [0])


def test_column_map_round_trips_through_the_index_file(tmp_path):
    cmap = {"text": "TEXT", "image": "jpg"}
    t = SampleTable.from_records(records(), column_map=cmap)
    path = write_index(t, tmp_path / "i.parquet")
    back = read_index(path)
    assert back.column_map == cmap
    assert back.take([2, 0]).column_map == cmap
    assert (
        read_index(
            write_index(SampleTable.from_records(records()), tmp_path / "j.parquet")
        ).column_map
        == {}
    )
    other = SampleTable.from_records(
        [SampleMeta("z", "u.parquet", 1, row=0)], column_map={"text": "caption"}
    )
    with pytest.raises(InvalidInput, match="maps 'text' to column 'caption'"):
        SampleTable.concat([t, other])
    with pytest.raises(InvalidInput, match="column_map"):
        SampleTable.from_records(records(), column_map={"text": 3})


def test_malformed_column_map_in_the_file_is_named(tmp_path):
    arrow = SampleTable.from_records(records()).to_arrow()
    arrow = arrow.replace_schema_metadata({b"entrain_data.column_map": b"{not json"})
    pq.write_table(arrow, tmp_path / "bad.parquet")
    with pytest.raises(InvalidInput, match="column map in the index metadata is not JSON"):
        read_index(tmp_path / "bad.parquet")
