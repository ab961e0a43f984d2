"""The wire format, without sockets: round trips, and every way a frame can be wrong."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrain_data.errors import ProtocolError
from entrain_data.protocol import DTYPES, PROTOCOL_VERSION, decode, decode_header, encode


def _frames_as_bytes(frames):
    return [bytes(f) for f in frames]


def test_round_trip_keeps_fields_and_tensors():
    tensors = {
        "input_ids": np.arange(10, dtype=np.int64),
        "pixel_values": np.random.default_rng(0).random((3, 4), dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float32),
    }
    frames = encode("batch", {"iteration": 3, "llm_keys": ["a", "b"]}, tensors)
    msg = decode(_frames_as_bytes(frames))
    assert msg.kind == "batch"
    assert msg.header["iteration"] == 3 and msg.header["llm_keys"] == ["a", "b"]
    got = msg.arrays()
    assert list(got) == list(tensors)
    for name, arr in tensors.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
        np.testing.assert_array_equal(got[name], arr)


def test_encode_does_not_copy_contiguous_buffers():
    arr = np.arange(1000, dtype=np.float32)
    frames = encode("result", {}, {"x": arr})
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), arr)


def test_non_contiguous_input_is_made_contiguous():
    arr = np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2]
    msg = decode(_frames_as_bytes(encode("batch", {}, {"x": arr})))
    np.testing.assert_array_equal(msg.arrays()["x"], arr)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    iteration=st.integers(0, 2**40),
    keys=st.lists(st.text(min_size=1, max_size=8), max_size=5),
)
def test_hypothesis_round_trip(dtype, shape, iteration, keys):
    arr = (np.arange(int(np.prod(shape)), dtype=np.int64) % 7).astype(dtype).reshape(shape)
    msg = decode(
        _frames_as_bytes(encode("batch", {"iteration": iteration, "keys": keys}, {"t": arr}))
    )
    assert msg.header == {"iteration": iteration, "keys": keys}
    np.testing.assert_array_equal(msg.arrays()["t"], arr)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_garbage_frames_raise_protocol_error_only(frames):
    with contextlib.suppress(ProtocolError):  # the only acceptable failure
        decode(frames)


def _header(**over):
    h = {"v": PROTOCOL_VERSION, "kind": "batch", "tensors": [["x", "int64", [2], 16]]}
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty"),
        ([b"\xc1\xc1"], "msgpack"),
        ([msgpack.packb([1, 2])], "map"),
        ([_header(v=PROTOCOL_VERSION + 1), bytes(16)], "version"),
        ([_header(v=None), bytes(16)], "version"),
        ([_header(kind="pickle"), bytes(16)], "kind"),
        ([_header()], "buffer frame"),
        ([_header(), bytes(16), bytes(8)], "buffer frame"),
        ([_header(), bytes(15)], "15 bytes"),
        ([_header(tensors=[["x", "object", [2], 16]]), bytes(16)], "dtype"),
        ([_header(tensors=[["x", "int64", [-2], 16]]), bytes(16)], "shape"),
        ([_header(tensors=[["x", "int64", [3], 16]]), bytes(16)], "24 bytes"),
        ([_header(tensors=[["x", "int64"]]), bytes(16)], "spec"),
        ([_header(tensors=[["", "int64", [2], 16]]), bytes(16)], "name"),
        (
            [
                _header(tensors=[["x", "int64", [2], 16], ["x", "int64", [2], 16]]),
                bytes(16),
                bytes(16),
            ],
            "duplicate",
        ),
        ([_header(tensors="x")], "list"),
    ],
)
def test_malformed_messages_are_named(frames, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_encode_rejects_bad_kind_dtype_and_reserved_fields():
    with pytest.raises(ProtocolError, match="kind"):
        encode("nope")
    with pytest.raises(ProtocolError, match="dtype"):
        encode("batch", {}, {"x": np.array(["a"], dtype=object)})
    with pytest.raises(ProtocolError, match="reserved"):
        encode("batch", {"v": 9})
    with pytest.raises(ProtocolError, match="msgpack"):
        encode("batch", {"x": object()})


def test_decode_header_alone_checks_version():
    assert decode_header(encode("hello", {"rank": 1})[0])["rank"] == 1
    with pytest.raises(ProtocolError, match="version"):
        decode_header(msgpack.packb({"v": 0, "kind": "hello"}))
