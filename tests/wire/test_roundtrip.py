"""Round trips through the DSSST1 codec: structures, dtypes, tensor types, zero-copy views."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from arctic_platform import wire

NUMPY_DTYPES = [
    np.float64,
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint64,
    np.uint32,
    np.uint16,
    np.uint8,
    np.bool_,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e5m2fnuz,
]
TORCH_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint64,
    torch.uint32,
    torch.uint16,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
]


def _random_bytes_array(dtype, shape, seed: int) -> np.ndarray:
    """Arbitrary bit patterns (NaNs included) so equality is checked bitwise."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize)
    array = raw.astype(np.uint8).view(dtype).reshape(shape)
    return (array != 0) if dtype == np.bool_ else array


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def assert_same(decoded, original) -> None:
    """Structure, types, dtypes, shapes and bits are all preserved."""
    if isinstance(original, torch.Tensor):
        assert isinstance(decoded, torch.Tensor)
        assert decoded.dtype == original.dtype and decoded.shape == original.shape
        assert bytes(decoded.reshape(-1).view(torch.uint8).numpy()) == bytes(
            original.contiguous().reshape(-1).view(torch.uint8).numpy()
        )
    elif isinstance(original, (np.ndarray, np.generic)):
        original = np.asarray(original)
        assert isinstance(decoded, np.ndarray)
        assert decoded.dtype == original.dtype and decoded.shape == original.shape
        assert _bits(decoded) == _bits(original)
    elif isinstance(original, dict):
        assert isinstance(decoded, dict) and list(decoded) == list(original)
        for key in original:
            assert_same(decoded[key], original[key])
    elif isinstance(original, (list, tuple)):
        assert type(decoded) is type(original) and len(decoded) == len(original)
        for d, o in zip(decoded, original, strict=True):
            assert_same(d, o)
    else:
        assert decoded == original and type(decoded) is type(original)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3), (2, 0, 4)])
def test_every_numpy_dtype_and_shape_round_trips(dtype, shape):
    array = _random_bytes_array(dtype, shape, seed=len(shape))
    assert_same(wire.loads(wire.dumps({"x": array})), {"x": array})


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_round_trips_as_torch(dtype):
    raw = torch.randint(0, 256, (4 * 3 * torch.empty(0, dtype=dtype).element_size(),))
    tensor = raw.to(torch.uint8).view(dtype).reshape(4, 3)
    decoded = wire.loads(wire.dumps({"t": tensor, "s": tensor[0, 0]}), tensor_type="torch")
    assert_same(decoded, {"t": tensor, "s": tensor[0, 0]})
    assert decoded["s"].dim() == 0


def test_torch_tensors_decode_as_numpy_with_matching_dtypes():
    tensors = {
        "bf16": torch.randn(3, dtype=torch.bfloat16),
        "u16": torch.arange(3).to(torch.uint16),
    }
    decoded = wire.loads(wire.dumps(tensors))
    assert decoded["bf16"].dtype == ml_dtypes.bfloat16
    assert decoded["bf16"].astype(np.float32).tolist() == tensors["bf16"].float().tolist()
    assert decoded["u16"].dtype == np.uint16 and decoded["u16"].tolist() == [0, 1, 2]


def test_non_contiguous_big_endian_grad_and_conj_tensors_encode_by_value():
    base = torch.arange(12.0, requires_grad=True).reshape(3, 4)
    obj = {
        "transposed": base.t(),
        "big_endian": np.arange(4, dtype=">i4"),
        "sliced": np.arange(10)[::3],
        "conj": torch.tensor([1 + 2j], dtype=torch.complex64).conj(),
    }
    decoded = wire.loads(wire.dumps(obj), tensor_type="torch")
    assert torch.equal(decoded["transposed"], base.detach().t())
    assert decoded["big_endian"].tolist() == [0, 1, 2, 3]
    assert decoded["sliced"].tolist() == [0, 3, 6, 9]
    assert decoded["conj"].tolist() == [1 - 2j]


def test_tensor_free_objects_tuples_and_root_tensors():
    for obj in [None, 3, "x", [1, 2], {"a": [1, {"b": None}]}, (1, "two"), ((), [()])]:
        assert_same(wire.loads(wire.dumps(obj)), expected(obj))
    assert wire.loads(wire.dumps(((), [()]))) == ((), [[]])
    root = np.arange(5, dtype=np.int32)
    assert_same(wire.loads(wire.dumps(root)), root)
    assert_same(wire.loads(wire.dumps((root, 1))), (root, 1))


def test_json_only_subtrees_follow_json_rules():
    # Inside a tensor-free subtree, tuples become lists and int keys become strings (JSON).
    decoded = wire.loads(wire.dumps({"t": np.zeros(1), "meta": {"pair": (1, 2), 3: "x"}}))
    assert decoded["meta"] == {"pair": [1, 2], "3": "x"}


def test_numpy_scalars_become_zero_dim_arrays():
    decoded = wire.loads(wire.dumps({"lr": np.float32(0.5), "step": np.int64(3)}))
    assert decoded["lr"].shape == () and decoded["lr"].dtype == np.float32
    assert decoded["step"].item() == 3


def _has_array(value) -> bool:
    if isinstance(value, dict):
        return any(_has_array(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_array(v) for v in value)
    return isinstance(value, np.ndarray)


def expected(value):
    """What a round trip must return: tensor-free dicts/lists follow JSON (tuples in them become
    lists); every tuple reached on a tensor path or at the root stays a tuple."""
    if isinstance(value, tuple):
        return tuple(expected(v) for v in value)
    if isinstance(value, (dict, list)) and not _has_array(value):
        return json.loads(json.dumps(value))
    if isinstance(value, dict):
        return {k: expected(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expected(v) for v in value]
    return value


nested = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(min_size=1, max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
# hypothesis generates values for numpy's own dtypes; the ml_dtypes ones are covered above.
STANDARD_DTYPES = [d for d in NUMPY_DTYPES if d.__module__ == "numpy"]
arrays = st.sampled_from(STANDARD_DTYPES).flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, max_side=3))
)


def _with_arrays(value, data):
    """Replace some leaves of a nested value with arrays."""
    if isinstance(value, dict):
        return {k: _with_arrays(v, data) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_arrays(v, data) for v in value]
    if isinstance(value, tuple):
        return tuple(_with_arrays(v, data) for v in value)
    return data.draw(arrays) if data.draw(st.booleans()) else value


@settings(max_examples=300, deadline=None)
@given(nested, st.data())
def test_property_nested_structures_round_trip(value, data):
    obj = _with_arrays(value, data)
    try:
        frame = wire.dumps(obj)
    except wire.WireError as exc:
        # Only dotted-path collisions (e.g. keys "a.b" and "a" -> "b") may refuse to encode.
        assert "same key" in str(exc)
        return
    assert_same(wire.loads(frame), expected(obj))


def test_decode_is_zero_copy_and_writability_follows_the_buffer():
    obj = {"a": np.arange(16, dtype=np.int64), "b": np.ones((2, 2), np.float32)}
    frame = wire.dumps(obj)
    decoded = wire.loads(frame)
    for array in decoded.values():
        assert np.shares_memory(array, np.frombuffer(frame, np.uint8))
        assert not array.flags.writeable
    writable = bytearray(frame)
    decoded = wire.loads(writable)
    decoded["a"][0] = 99
    assert wire.loads(bytes(writable))["a"][0] == 99
    as_torch = wire.loads(writable, tensor_type="torch")
    assert as_torch["a"].data_ptr() == decoded["a"].ctypes.data


def test_dumps_buffers_concatenate_to_dumps_and_alias_the_tensors():
    tensor = torch.arange(8, dtype=torch.float32)
    obj = {"t": tensor, "meta": {"k": 1}, "n": np.arange(3, dtype=np.int16)}
    buffers = wire.dumps_buffers(obj, metadata={"op": "x"})
    assert b"".join(buffers) == wire.dumps(obj, metadata={"op": "x"})
    tensor_view = next(b for b in buffers[1:] if len(b) == 32)
    tensor[0] = 42.0
    assert np.frombuffer(tensor_view, np.float32)[0] == 42.0


def test_metadata_round_trips_and_reads_without_decoding():
    frame = wire.dumps({"x": np.zeros(2)}, metadata={"response_options": {"format": "dssst1"}})
    assert wire.read_metadata(frame) == {"response_options": {"format": "dssst1"}}
    assert wire.read_metadata(wire.dumps({"x": 1})) == {}
    assert wire.read_metadata(b"garbage!") == {}


def test_large_frame_round_trips():
    big = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)
    decoded = wire.loads(wire.dumps({"w": big}))
    assert np.array_equal(decoded["w"], big)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_to_numpy_keeps_dtype_shape_and_bits_and_shares_cpu_memory(dtype):
    raw = torch.randint(0, 256, (2 * 3 * torch.empty(0, dtype=dtype).element_size(),))
    tensor = raw.to(torch.uint8).view(dtype).reshape(2, 3)
    if dtype == torch.bool:  # only 0 and 1 are valid booleans
        tensor = tensor.view(torch.uint8) % 2 == 1
    array = wire.to_numpy(tensor)
    assert array.shape == (2, 3)
    assert wire.loads(wire.dumps(tensor)).dtype == array.dtype
    assert array.tobytes() == bytes(tensor.reshape(-1).view(torch.uint8).numpy())
    assert array.ctypes.data == tensor.data_ptr()
    transposed = wire.to_numpy(tensor.t())  # non-contiguous: copied, same values
    assert transposed.shape == (3, 2)
    assert transposed.tobytes() == np.ascontiguousarray(array.T).tobytes()
