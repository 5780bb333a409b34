"""Torch tensors to numpy arrays and back, through nested dicts, lists and tuples: how tensors
cross a process boundary through Ray's object store.

Numpy arrays pass through the object store zero-copy (the receiver gets read-only views of shared
memory); torch tensors would be pickled, 10-100x slower. So the sender turns tensors into arrays
viewing the same memory (:func:`to_object_store`) and a receiver that wants torch wraps them
again (:func:`numpy_to_torch`). Both sides of the Ray backend use this module: the client's ray
transport and the server's engine proxies and worker actors. It imports torch only when handed a
torch tensor (then torch is loaded already) or asked for torch tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from arctic_platform import wire
from arctic_platform._extras import require


def to_object_store(value: Any) -> Any:
    """``value`` with each torch tensor as a numpy array (on CPU, sharing its memory); bf16
    tensors, which numpy lacks, stay torch (on CPU)."""
    if wire.is_torch_tensor(value):
        value = value.detach().cpu()
        return value if str(value.dtype) == "torch.bfloat16" else value.numpy()
    if isinstance(value, Mapping):
        return {k: to_object_store(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_object_store(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_object_store(v) for v in value)
    return value


def numpy_to_torch(value: Any, *, copy_read_only: bool = False) -> Any:
    """``value`` with each numpy array as a torch tensor sharing its memory (bf16 and float8
    arrays included, through :func:`arctic_platform.wire.to_torch`).

    Arrays from the object store are read-only views; torch has no read-only tensors, so with
    ``copy_read_only`` they are copied first (for tensors that may be written), and otherwise
    wrapped as they are (torch's warning about that is silenced).
    """
    if isinstance(value, np.ndarray):
        require("torch", "engine", purpose="torch tensors")  # imported: wire.to_torch uses it
        if copy_read_only and not value.flags.writeable:
            value = value.copy()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return wire.to_torch(np.ascontiguousarray(value))
    if isinstance(value, Mapping):
        return {k: numpy_to_torch(v, copy_read_only=copy_read_only) for k, v in value.items()}
    if isinstance(value, list):
        return [numpy_to_torch(v, copy_read_only=copy_read_only) for v in value]
    if isinstance(value, tuple):
        return tuple(numpy_to_torch(v, copy_read_only=copy_read_only) for v in value)
    return value
