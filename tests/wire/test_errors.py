"""Malformed input: every failure is a WireError with a message that says what is wrong."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
import torch

from arctic_platform import wire


def frame_with_header(header: dict, data: bytes = b"", pad: bool = True) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def dss(tree, version="DSSST1") -> dict:
    return {"dss": json.dumps({"v": version, "tree": tree})}


VALID_TENSOR = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}


@pytest.mark.parametrize("value", ["text", 3, None, [b"x"], np.zeros(3)])
def test_non_bytes_input_is_rejected(value):
    with pytest.raises(wire.WireError, match="expects bytes"):
        wire.loads(value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "shorter than the 8-byte length prefix"),
        (b"\x01\x00\x00", "shorter than the 8-byte length prefix"),
        (struct.pack("<Q", 0) + b"{}", "outside 1.."),
        (struct.pack("<Q", 100) + b"{}", "exceeds the"),
        (struct.pack("<Q", 64 * 1024 * 1024 + 8) + b"{}", "outside 1.."),
        (struct.pack("<Q", 8) + b"not json", "not valid JSON"),
        (struct.pack("<Q", 8) + b"[1,2,3] ", "not a JSON object"),
        (struct.pack("<Q", 8) + b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8", "not valid JSON"),
    ],
)
def test_truncated_or_oversized_headers(data, message):
    with pytest.raises(wire.WireError, match=message):
        wire.loads(data)


def test_truncated_frame_is_rejected():
    frame = wire.dumps({"x": np.arange(10)})
    for cut in (len(frame) - 1, len(frame) - 40, 12):
        with pytest.raises(wire.WireError):
            wire.loads(frame[:cut])


def test_trailing_bytes_are_rejected():
    with pytest.raises(wire.WireError, match="not fully covered"):
        wire.loads(wire.dumps({"x": np.arange(3)}) + b"\x00")


@pytest.mark.parametrize(
    ("tensors", "data", "message"),
    [
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"xyz", "do not tile"),
        (
            {
                "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
            },
            b"xyz",
            "do not tile",
        ),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"xxxx", "do not match"),
        ({"a": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 1]}}, b"x", "unsupported dtype"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"x", "invalid shape"),
        ({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"x", "invalid shape"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 9]}}, b"x", "data_offsets"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}}, b"x", "data_offsets"),
        ({"a": {"dtype": "U8", "shape": [1]}}, b"x", "exactly dtype, shape and data_offsets"),
        ({"a": "tensor"}, b"x", "exactly dtype"),
        (
            {"a": {"dtype": "U8", "shape": [2**62, 2**62], "data_offsets": [0, 1]}},
            b"x",
            "do not match",
        ),
    ],
)
def test_tensor_table_must_tile_the_buffer_exactly(tensors, data, message):
    frame = frame_with_header({"__metadata__": dss(["t", "a"]), **tensors}, data)
    with pytest.raises(wire.WireError, match=message):
        wire.loads(frame)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({}, "no DSSST1 structure metadata"),
        ({"dss": "{not json"}, "not valid JSON"),
        ({"dss": json.dumps([1])}, "must be an object with a 'tree'"),
        (dss(["j", 1], version="DSSST0"), "unsupported DSSST1 wire version 'DSSST0'"),
        ({"dss": json.dumps({"tree": ["j", 1]})}, "unsupported DSSST1 wire version None"),
    ],
)
def test_structure_metadata_is_checked(metadata, message):
    frame = frame_with_header({"__metadata__": metadata, "__dss_empty__": VALID_TENSOR}, b"\x00")
    with pytest.raises(wire.WireError, match=message):
        wire.loads(frame)


def test_non_string_metadata_values_are_rejected():
    frame = frame_with_header({"__metadata__": {"dss": 1}, "__dss_empty__": VALID_TENSOR}, b"\x00")
    with pytest.raises(wire.WireError, match="must map strings to strings"):
        wire.loads(frame)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (["z", 1], "unknown structure node tag 'z'"),
        ("j", "malformed structure node"),
        ([], "malformed structure node"),
        ([1, 2], "malformed structure node"),
        (["t", "missing"], "unknown tensor 'missing'"),
        (["t", 5], "unknown tensor 5"),
        (["l", [["t", "a"], ["t", "a"]]], "references tensor 'a' twice"),
        (["t", "a", {"scalar": "yes"}], "invalid options"),
        (["t", "a", {"scalar": True}], "must be stored with shape \\[1\\]"),
        (["d", [["k"]]], "malformed dict entry"),
        (["d", [[1, ["j", 1]]]], "malformed dict entry"),
        (["d", [["k", ["t", "a"]], ["k", ["j", 1]]]], "repeats key 'k'"),
        (["l", "abc"], "malformed 'l' structure node"),
        (["j"], "malformed 'j' structure node"),
        (["j", 1], "not referenced by the structure tree"),
    ],
)
def test_structure_tree_is_validated(tree, message):
    frame = frame_with_header(
        {"__metadata__": dss(tree), "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}},
        b"\x01\x02",
    )
    with pytest.raises(wire.WireError, match=message):
        wire.loads(frame)


def test_deeply_nested_trees_fail_cleanly():
    for depth in (300, 100_000):  # past our limit; past Python's recursion limit
        tree = '["l", [' * depth + '["j", 0]' + "]]" * depth
        structure = '{"v": "DSSST1", "tree": ' + tree + "}"
        frame = frame_with_header(
            {"__metadata__": {"dss": structure}, "__dss_empty__": VALID_TENSOR}, b"\x00"
        )
        with pytest.raises(wire.WireError, match="deeper than|not valid JSON"):
            wire.loads(frame)
    deep: list = []
    for _ in range(300):
        deep = [deep, np.zeros(1)]
    with pytest.raises(wire.WireError, match="deeper than"):
        wire.dumps(deep)


def test_legacy_pickle_and_torch_save_payloads_are_refused_with_a_clear_message():
    with pytest.raises(wire.WireError, match="legacy pickle/torch.save"):
        wire.loads(pickle.dumps({"a": 1}, protocol=4))
    import io

    buffer = io.BytesIO()
    torch.save({"a": torch.ones(2)}, buffer)
    with pytest.raises(wire.WireError, match="legacy pickle/torch.save"):
        wire.loads(buffer.getvalue())


def test_a_valid_frame_whose_length_prefix_looks_like_pickle_still_decodes():
    # A header of 640 bytes starts with 0x80 0x02, the pickle-2 signature.
    for pad in range(600):
        frame = wire.dumps({"k" * pad: np.zeros(1, np.uint8)})
        if frame[:2] == b"\x80\x02":
            assert wire.loads(frame)["k" * pad].tolist() == [0]
            return
    pytest.fail("no frame with a 640-byte header was produced")


def test_dotted_path_collisions_are_refused_on_encode():
    with pytest.raises(wire.WireError, match="same key 'a.b'"):
        wire.dumps({"a.b": np.zeros(1), "a": {"b": np.ones(1)}})
    with pytest.raises(wire.WireError, match="same key 'x.0'"):
        wire.dumps({"x": [np.zeros(1)], "x.0": np.ones(1)})


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"t": np.zeros(1), 3: np.zeros(1)}, "dict key 3 is not a str"),
        ({"t": np.zeros(1), "b": b"bytes"}, "b: cannot encode a bytes"),
        ({"t": np.zeros(1), "s": {1, 2}}, "s: cannot encode a set"),
        ({"s": {1, 2}}, "not JSON-serialisable"),
        ({"o": np.array([object()])}, "o: dtype object has no safetensors equivalent"),
        ({"c": np.zeros(2, np.complex128)}, "c: dtype complex128 has no safetensors equivalent"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, "c: dtype torch.complex128"),
    ],
)
def test_unencodable_objects_raise_wire_errors_naming_the_path(obj, message):
    with pytest.raises(wire.WireError, match=message):
        wire.dumps(obj)


def test_bad_metadata_and_tensor_type_arguments():
    with pytest.raises(wire.WireError, match="metadata must be a dict"):
        wire.dumps({}, metadata=["x"])
    with pytest.raises(wire.WireError, match="tensor_type must be"):
        wire.loads(wire.dumps({"x": np.zeros(1)}), tensor_type="jax")


def empty_tensors_frame(count: int) -> bytes:
    """A frame whose header declares ``count`` empty tensors (and a tree using none of them)."""
    header = {"__metadata__": dss(["j", None])}
    header.update(
        {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    )
    return frame_with_header(header)


def test_a_header_declaring_more_tensors_than_the_cap_is_refused_naming_it():
    frame = empty_tensors_frame(wire.MAX_FRAME_TENSORS + 1)
    with pytest.raises(wire.WireError, match=f"more than {wire.MAX_FRAME_TENSORS} tensors"):
        wire.loads(frame)
    assert wire.read_metadata(frame) == {}


def test_a_frame_of_exactly_the_tensor_cap_still_decodes_up_to_its_tree():
    # Every entry parses; what fails is only that the tree uses none of them.
    with pytest.raises(wire.WireError, match="not referenced by the structure tree"):
        wire.loads(empty_tensors_frame(wire.MAX_FRAME_TENSORS))


def test_a_structure_tree_over_the_node_cap_is_refused_naming_it():
    tree = ["l", [["j", 0]] * wire.MAX_TREE_NODES]
    frame = frame_with_header({"__metadata__": dss(tree)})
    with pytest.raises(wire.WireError, match=f"more than {wire.MAX_TREE_NODES} nodes"):
        wire.loads(frame)


def test_an_integer_too_long_for_python_in_the_tree_is_a_wire_error():
    text = json.dumps({"v": "DSSST1", "tree": ["j", 0]}).replace("0", "1" * 5000)
    frame = frame_with_header({"__metadata__": {"dss": text}})
    with pytest.raises(wire.WireError, match="4300 digits"):
        wire.loads(frame)


def test_header_bytes_reads_the_declared_header_size_only_when_the_frame_holds_it():
    frame = wire.dumps({"x": np.zeros(3)})
    assert wire.header_bytes(frame) == struct.unpack("<Q", frame[:8])[0]
    assert wire.header_bytes(frame[:20]) == 0
    assert wire.header_bytes(b"abc") == 0
