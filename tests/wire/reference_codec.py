"""An independent DSSST1 codec written from the format facts, on top of the safetensors library.

It follows the reference implementation's algorithm (reference/client_wire_api.md §1): the
structure tree in ``__metadata__["dss"]`` serialised with ``json.dumps`` defaults, tensors saved by
``safetensors.torch.save`` under their dotted paths, the ``__dss_empty__`` placeholder for
tensor-free objects. Tests use it as the other side of the compatibility checks: our frames must
decode here, and its frames must decode with ``arctic_platform.wire``.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def _has_tensor(value) -> bool:
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def reference_dumps(obj, metadata=None) -> bytes:
    tensors: dict[str, torch.Tensor] = {}

    def node(value, path):
        if isinstance(value, torch.Tensor):
            key = path or "__root__"
            tensor = value.detach().cpu().contiguous()
            if tensor.dim() == 0:
                tensors[key] = tensor.reshape(1)
                return ["t", key, {"scalar": True}]
            tensors[key] = tensor.clone()
            return ["t", key]

        def child(key):
            return f"{path}.{key}" if path else str(key)

        if isinstance(value, tuple):
            return ["u", [node(v, child(i)) for i, v in enumerate(value)]]
        if isinstance(value, list) and _has_tensor(value):
            return ["l", [node(v, child(i)) for i, v in enumerate(value)]]
        if isinstance(value, dict) and _has_tensor(value):
            return ["d", [[k, node(v, child(k))] for k, v in value.items()]]
        return ["j", value]

    tree = node(obj, "")
    if not tensors:
        tensors["__dss_empty__"] = torch.zeros(1, dtype=torch.uint8)
    meta = {"dss": json.dumps({"v": "DSSST1", "tree": tree})}
    if metadata:
        meta["op"] = json.dumps(metadata)
    return st_save(tensors, metadata=meta)


def reference_loads(data: bytes):
    tensors = st_load(bytes(data))
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + header_len]))
    structure = json.loads(header["__metadata__"]["dss"])
    assert structure["v"] == "DSSST1"

    def build(node):
        tag = node[0]
        if tag == "t":
            tensor = tensors[node[1]]
            scalar = len(node) == 3 and node[2].get("scalar")
            return tensor.reshape(()) if scalar else tensor
        if tag == "j":
            return node[1]
        if tag == "d":
            return {k: build(v) for k, v in node[1]}
        if tag == "l":
            return [build(v) for v in node[1]]
        if tag == "u":
            return tuple(build(v) for v in node[1])
        raise ValueError(tag)

    return build(structure["tree"])
