"""Byte compatibility with the reference DSSST1 format and the safetensors library."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_numpy_load

from arctic_platform import wire
from tests.wire.reference_codec import reference_dumps, reference_loads


def header_of(frame: bytes) -> tuple[int, dict]:
    (size,) = struct.unpack("<Q", frame[:8])
    return size, json.loads(frame[8 : 8 + size])


def test_worked_example_with_op_metadata_matches_reference_section_1_4():
    obj = {
        "input_ids": torch.tensor([[1, 2], [3, 4]]),
        "adv": torch.tensor([0.5, -0.5]),
        "meta": {"k": 1},
        "temperature": torch.tensor(1.0),
    }
    op = {"response_options": {"format": "dssst1", "delivery": "chunked"}}
    frame = wire.dumps(obj, metadata=op)
    size, header = header_of(frame)
    assert (size, len(frame)) == (504, 556)
    assert header["input_ids"] == {"dtype": "I64", "shape": [2, 2], "data_offsets": [0, 32]}
    assert header["adv"] == {"dtype": "F32", "shape": [2], "data_offsets": [32, 40]}
    assert header["temperature"] == {"dtype": "F32", "shape": [1], "data_offsets": [40, 44]}
    assert json.loads(header["__metadata__"]["op"]) == op
    assert json.loads(header["__metadata__"]["dss"]) == {
        "v": "DSSST1",
        "tree": [
            "d",
            [
                ["input_ids", ["t", "input_ids"]],
                ["adv", ["t", "adv"]],
                ["meta", ["j", {"k": 1}]],
                ["temperature", ["t", "temperature", {"scalar": True}]],
            ],
        ],
    }
    assert size % 8 == 0
    assert len(frame) == len(reference_dumps(obj, metadata=op))


def test_worked_json_only_example_matches_reference_section_1_4():
    frame = wire.dumps({"prompts": ["hi"], "sampling_params": None})
    size, header = header_of(frame)
    assert (size, len(frame)) == (184, 193)
    assert header["__dss_empty__"] == {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
    assert frame[-1:] == b"\x00"
    assert frame == reference_dumps({"prompts": ["hi"], "sampling_params": None})


SAMPLES = [
    {
        "batch": {
            "input_ids": torch.arange(12).reshape(3, 4),
            "mask": torch.ones(3, 4, dtype=torch.bool),
        }
    },
    {
        "nested": [torch.randn(2), {"x": torch.tensor(3, dtype=torch.int32)}],
        "pair": (1, torch.ones(1)),
    },
    (torch.randn(2, 2, dtype=torch.bfloat16), "label"),
    torch.arange(5, dtype=torch.uint8),
    {"prompts": [[1, 2, 3]], "sampling_params": {"n": 2}},
]


@pytest.mark.parametrize("obj", SAMPLES)
def test_our_frames_decode_with_the_reference_codec(obj):
    from tests.wire.test_roundtrip import assert_same

    assert_same(reference_loads(wire.dumps(obj)), obj)


@pytest.mark.parametrize("obj", SAMPLES)
def test_reference_frames_decode_with_ours(obj):
    from tests.wire.test_roundtrip import assert_same

    assert_same(wire.loads(reference_dumps(obj), tensor_type="torch"), obj)


def test_frames_load_with_the_safetensors_library():
    frame = wire.dumps(
        {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": [np.ones(2, np.int8)]}
    )
    loaded = st_numpy_load(frame)
    assert loaded["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert loaded["b.0"].tolist() == [1, 1]


def test_shared_storage_tensors_are_written_by_value():
    base = torch.arange(6.0)
    decoded = wire.loads(wire.dumps({"a": base, "b": base, "c": base[2:4]}), tensor_type="torch")
    assert decoded["a"].tolist() == decoded["b"].tolist() == base.tolist()
    assert decoded["c"].tolist() == [2.0, 3.0]
    assert decoded["a"].data_ptr() != decoded["b"].data_ptr()
