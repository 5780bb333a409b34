"""Tensors at the client edge: which type responses use, and conversions between them.

Responses carry numpy arrays or torch tensors, chosen by the config's ``tensor_type``: ``auto``
means torch when it can be imported (what SkyRL and verl expect) and numpy otherwise (a
client-only install). Nothing here imports torch unless torch is the chosen type.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from arctic_platform import wire

TensorType = Literal["numpy", "torch"]


def resolve_tensor_type(setting: str) -> TensorType:
    """``numpy`` or ``torch`` for a config value (``auto`` probes whether torch imports)."""
    if setting in ("numpy", "torch"):
        return setting  # type: ignore[return-value]
    try:
        importlib.import_module("torch")  # torch is what the caller's tensors will be
    except ImportError:
        return "numpy"
    return "torch"


is_torch_tensor = wire.is_torch_tensor


def is_tensor(value: Any) -> bool:
    """A numpy array, numpy scalar or torch tensor: what travels as a tensor on the wire."""
    return isinstance(value, (np.ndarray, np.generic)) or is_torch_tensor(value)


def torch_to_numpy(value: Any) -> Any:
    """``value`` with every torch tensor as a numpy array (in-process results, numpy callers);
    bf16 and float8 tensors become ``ml_dtypes`` arrays, as the wire decodes them."""
    if is_torch_tensor(value):
        return wire.to_numpy(value)
    if isinstance(value, Mapping):
        return {k: torch_to_numpy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [torch_to_numpy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(torch_to_numpy(v) for v in value)
    return value


def to_python(value: Any) -> Any:
    """Tensors as (nested) Python lists or scalars, tuples as lists: JSON-like values."""
    if is_torch_tensor(value):
        value = wire.to_numpy(value)
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    return value
