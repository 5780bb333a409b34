"""``tensor_tree``: torch tensors cross Ray's object store as numpy arrays viewing their memory,
and come back as torch tensors, through nested dicts, lists and tuples."""

from __future__ import annotations

import numpy as np
import torch

from arctic_platform.tensor_tree import numpy_to_torch, to_object_store


def test_tensors_become_arrays_sharing_memory_through_nested_values():
    logprobs = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ids = torch.tensor([3, 4], dtype=torch.int64)
    value = {"batch": {"logprobs": logprobs}, "rows": [ids, (ids, 7)], "name": "x"}
    out = to_object_store(value)
    assert isinstance(out["batch"]["logprobs"], np.ndarray)
    assert out["rows"][1][1] == 7 and out["name"] == "x"
    assert isinstance(out["rows"][1], tuple)
    np.testing.assert_array_equal(out["rows"][0], [3, 4])
    logprobs[0, 0] = 42.0  # a view, not a copy
    assert out["batch"]["logprobs"][0, 0] == 42.0


def test_bf16_tensors_stay_torch_because_numpy_lacks_the_dtype():
    weights = torch.ones(3, dtype=torch.bfloat16)
    out = to_object_store({"w": weights})["w"]
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16


def test_arrays_come_back_as_tensors_and_read_only_ones_are_copied_when_asked():
    array = np.arange(4, dtype=np.int64)
    array.flags.writeable = False  # as the object store hands arrays out
    shared = numpy_to_torch({"a": [array]})["a"][0]
    assert isinstance(shared, torch.Tensor) and shared.tolist() == [0, 1, 2, 3]
    copied = numpy_to_torch(array, copy_read_only=True)
    copied[0] = 9  # writing the copy leaves the store's array alone
    assert array[0] == 0
    round_trip = numpy_to_torch(to_object_store({"t": torch.tensor([1.5, 2.5])}))
    assert torch.equal(round_trip["t"], torch.tensor([1.5, 2.5]))
