"""DSSST1: the byte format every remote transport and the server speak.

A frame is exactly one safetensors blob (``u64 N`` little-endian, ``N`` bytes of JSON header padded
with spaces to a multiple of 8, then the tensor bytes). The nested Python structure travels as a
JSON *structure tree* in ``__metadata__["dss"]``; caller metadata (response options, chunk
descriptors) in ``__metadata__["op"]``. Tensors are stored under their dotted path. Frames made
here decode with the ``safetensors`` library and with the reference codec, and theirs decode here.

Why the codec writes and reads the layout itself instead of calling ``safetensors.save``/``load``:
those copy every tensor at least twice. Here

* **encode** (:func:`dumps`) allocates the output ``bytes`` once, uninitialised, and writes each
  tensor's bytes into it exactly once; :func:`dumps_buffers` returns the frame as a list of buffers
  (the header, then memoryviews of the tensors) with no copy at all, for transports that stream;
* **decode** (:func:`loads`) is zero-copy: arrays are views of the received buffer.

Aliasing and writability of decoded tensors: every array returned by :func:`loads` is a view into
``data`` and keeps it alive. If ``data`` is immutable (``bytes``), numpy arrays are read-only; torch
has no read-only tensors, so torch tensors then alias immutable memory and must not be written in
place (pass a ``bytearray`` or call ``.clone()`` first). If ``data`` is a writable ``bytearray`` or
``memoryview``, arrays are writable and writes go to ``data``. The arrays of :func:`dumps_buffers`
alias the caller's tensors until the buffers are sent.

Tensor types: with only numpy installed (the ``client`` extra) tensors are numpy arrays; dtypes
numpy lacks (bfloat16, the float8 types) use the ``ml_dtypes`` numpy dtypes, so bf16 round-trips
without torch. ``loads(..., tensor_type="torch")`` hands back torch tensors instead. Encoding
accepts numpy arrays, numpy scalars (stored as 0-d tensors) and torch tensors (copied to CPU if
needed).

Every malformed input raises :class:`WireError` (a ``ValueError``): never another exception type,
never a hang, and never an allocation driven by an untrusted size field.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import mmap
import struct
import sys
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

WIRE_FORMAT_VERSION = "DSSST1"
STRUCTURE_KEY = "dss"
OP_METADATA_KEY = "op"
REQUEST_CHUNK_KEY = "request_chunk"
RESULT_CHUNK_KEY = "result_chunk"
EMPTY_TENSOR_KEY = "__dss_empty__"
ROOT_TENSOR_KEY = "__root__"
PAYLOAD_KEY = "payload"
MAX_HEADER_BYTES = 64 * 1024 * 1024
CHUNK_OVERHEAD_BYTES = 8192
MAX_TREE_DEPTH = 256
# Tensors and structure-tree nodes in one frame. Each costs a few hundred bytes of Python objects
# and a view to build, so a header listing 650k empty tensors cost 774 MiB and 49 s to decode. A
# verl or SkyRL training batch carries 10-30 tensors, a per-row list (one array per sample, up to
# the server's 8192 rows) a few thousand: the caps are 100 x that, counted while the header is
# parsed so a frame over them is refused before its entries are built.
MAX_FRAME_TENSORS = 65_536
MAX_TREE_NODES = 1_048_576
# numpy 1.x arrays have at most 32 dimensions (numpy 2: 64); a frame may not ask for more.
MAX_TENSOR_DIMS = 32
# A shape's byte size counting zero dims as 1 must fit numpy's index type, or numpy refuses it
# even for a zero-size tensor.
_MAX_SHAPE_BYTES = 2**62

_CHUNK_KEYS = {"request": REQUEST_CHUNK_KEY, "result": RESULT_CHUNK_KEY}
_PICKLE_PREFIXES = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
_ZIP_PREFIX = b"PK\x03\x04"

TensorType = Literal["numpy", "torch"]


class WireError(ValueError):
    """A payload is malformed, truncated, of another version, or cannot be encoded."""


# ----------------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------------

_NUMPY_DTYPES: dict[str, np.dtype] = {  # numpy's own
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "C64": np.dtype("<c8"),
}
_CODE_OF_NUMPY = {dtype: code for code, dtype in _NUMPY_DTYPES.items()}
# The dtypes numpy lacks: their ml_dtypes name, and the same-width integer that carries their bytes
# (torch cannot wrap ml_dtypes arrays; they are viewed as that integer and reinterpreted).
# ml_dtypes is imported only when a frame holds one (see _numpy_dtype): its import costs 1.5-2 s,
# which every server, Ray worker and client process would otherwise pay at start.
_ML_DTYPES: dict[str, tuple[str, np.dtype]] = {
    "BF16": ("bfloat16", np.dtype("<u2")),
    "F8_E4M3": ("float8_e4m3fn", np.dtype("u1")),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", np.dtype("u1")),
    "F8_E5M2": ("float8_e5m2", np.dtype("u1")),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", np.dtype("u1")),
}
_TORCH_CARRIER = {code: carrier for code, (_, carrier) in _ML_DTYPES.items()}
_DTYPE_CODES = frozenset(_NUMPY_DTYPES) | frozenset(_ML_DTYPES)


def _numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of wire dtype ``code`` (an ml_dtypes one for bf16 and float8)."""
    dtype = _NUMPY_DTYPES.get(code)
    if dtype is None:
        import ml_dtypes

        dtype = np.dtype(getattr(ml_dtypes, _ML_DTYPES[code][0]))
    return dtype


def _itemsize(code: str) -> int:
    """Bytes per element of wire dtype ``code`` (without importing ml_dtypes)."""
    dtype = _NUMPY_DTYPES.get(code)
    return (dtype if dtype is not None else _TORCH_CARRIER[code]).itemsize


def _code_of(dtype: np.dtype) -> str | None:
    """The wire code of numpy ``dtype``, or None. An ml_dtypes array exists only once its caller
    imported ml_dtypes, so an unloaded ml_dtypes means the dtype is not one of its."""
    code = _CODE_OF_NUMPY.get(dtype)
    if code is None and "ml_dtypes" in sys.modules:
        code = next((c for c in _ML_DTYPES if _numpy_dtype(c) == dtype), None)
    return code


_TORCH_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def _torch_module():
    """torch if this process finished importing it; encoding never imports torch by itself.

    A torch another thread is still importing counts as absent: its half-built module has no
    ``Tensor`` yet (a job being created while a request is encoded hit exactly that), and no
    tensor can exist before the import ends."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (never imports torch: a tensor implies it is loaded)."""
    torch = _torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_code(tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    for code, torch_name in _TORCH_DTYPE_NAMES.items():
        if torch_name == name:
            return code
    raise WireError(f"dtype {tensor.dtype} has no safetensors equivalent")


# ----------------------------------------------------------------------------------------------
# uninitialised output buffers
# ----------------------------------------------------------------------------------------------

_new_raw_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_raw_bytes.restype = ctypes.py_object
_new_raw_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype = ctypes.c_void_p
_bytes_address.argtypes = (ctypes.py_object,)


class _RawView:
    """Exposes the storage of a fresh ``bytes`` object to numpy and keeps the object alive."""

    def __init__(self, owner: bytes, size: int) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "data": (_bytes_address(owner), False),
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }


_HUGE_PAGES = getattr(mmap, "MADV_HUGEPAGE", None)
_HUGE_PAGE_MIN_BYTES = 4 * 1024 * 1024
if _HUGE_PAGES is not None:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int


def _allocate(size: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` of ``size`` uninitialised bytes and a writable uint8 view of it.

    ``bytes(size)`` or ``bytearray(size)`` would zero-fill the buffer first, touching every page
    twice. The object is filled before anyone else can see it, which is how CPython builds bytes
    internally too. Large buffers are advised to use transparent huge pages, as numpy does for its
    own allocations: first-touch page faults otherwise cut the copy speed by about 4x.
    """
    out = _new_raw_bytes(None, size)
    view = np.asarray(_RawView(out, size))
    if _HUGE_PAGES is not None and size >= _HUGE_PAGE_MIN_BYTES:
        start = (view.ctypes.data + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
        end = (view.ctypes.data + size) & ~(mmap.PAGESIZE - 1)
        _madvise(start, end - start, _HUGE_PAGES)  # advisory: failure only costs speed
    return out, view


# ----------------------------------------------------------------------------------------------
# encode
# ----------------------------------------------------------------------------------------------


@dataclass
class _Tensor:
    code: str
    shape: list[int]
    raw: np.ndarray  # 1-D uint8, C-contiguous

    @property
    def itemsize(self) -> int:
        return _itemsize(self.code)


def _numpy_tensor(array: np.ndarray, path: str) -> _Tensor:
    dtype = array.dtype
    if dtype.byteorder == ">":
        array = array.astype(dtype.newbyteorder("<"))
        dtype = array.dtype
    code = _code_of(dtype)
    if code is None:
        raise WireError(f"{path or 'object'}: dtype {dtype} has no safetensors equivalent")
    shape = list(array.shape)  # before ascontiguousarray, which turns 0-d into 1-d
    return _Tensor(code, shape, np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _torch_tensor(tensor, path: str) -> _Tensor:
    try:
        code = _torch_code(tensor)
    except WireError as exc:
        raise WireError(f"{path or 'object'}: {exc}") from None
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    torch = _torch_module()
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return _Tensor(code, list(tensor.shape), raw)


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor as a numpy array of the same dtype (ml_dtypes for bf16 and float8).

    ``tensor.numpy()`` refuses the dtypes numpy lacks; this views their bytes instead. CPU
    tensors are shared, not copied (a non-contiguous or GPU tensor is copied once).
    """
    packed = _torch_tensor(tensor, "tensor")
    return packed.raw.view(_numpy_dtype(packed.code)).reshape(packed.shape)


def to_torch(array: np.ndarray):
    """A numpy array as a torch tensor sharing its memory, the ml_dtypes ones (bf16, float8)
    included: ``torch.from_numpy`` refuses those, so their bytes are viewed as the same-width
    integer and reinterpreted (the inverse of :func:`to_numpy`). Only for a caller that works in
    torch: it raises if torch was not imported."""
    torch = _torch_module()
    if torch is None:
        raise RuntimeError("to_torch: torch is not imported")
    code = _code_of(array.dtype)
    if code in _TORCH_CARRIER:
        carried = torch.from_numpy(array.view(_TORCH_CARRIER[code]))
        return carried.view(getattr(torch, _TORCH_DTYPE_NAMES[code]))
    return torch.from_numpy(array)


class _Encoder:
    """Walks an object into a structure tree and the flat list of tensors it references."""

    def __init__(self) -> None:
        self.tensors: dict[str, _Tensor] = {}
        self._torch = _torch_module()

    def _tensor_of(self, value: Any, path: str) -> _Tensor | None:
        if isinstance(value, np.ndarray):
            return _numpy_tensor(value, path)
        if isinstance(value, np.generic):
            return _numpy_tensor(np.asarray(value), path)
        if self._torch is not None and isinstance(value, self._torch.Tensor):
            return _torch_tensor(value, path)
        return None

    def has_tensor(self, value: Any, depth: int = 0) -> bool:
        if depth > MAX_TREE_DEPTH:
            raise WireError(f"object nests deeper than {MAX_TREE_DEPTH} levels")
        if isinstance(value, dict):
            return any(self.has_tensor(v, depth + 1) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self.has_tensor(v, depth + 1) for v in value)
        return isinstance(value, (np.ndarray, np.generic)) or (
            self._torch is not None and isinstance(value, self._torch.Tensor)
        )

    def node(self, value: Any, path: str, depth: int = 0) -> list:
        if depth > MAX_TREE_DEPTH:
            raise WireError(f"object nests deeper than {MAX_TREE_DEPTH} levels")
        tensor = self._tensor_of(value, path)
        if tensor is not None:
            key = path or ROOT_TENSOR_KEY
            if key in self.tensors:
                raise WireError(
                    f"two tensors map to the same key {key!r}; rename a key that contains '.'"
                )
            scalar = not tensor.shape
            if scalar:
                tensor.shape = [1]
            self.tensors[key] = tensor
            return ["t", key, {"scalar": True}] if scalar else ["t", key]
        if isinstance(value, tuple):
            return ["u", [self.node(v, _join(path, i), depth + 1) for i, v in enumerate(value)]]
        if isinstance(value, (dict, list)) and self.has_tensor(value, depth):
            if isinstance(value, list):
                return ["l", [self.node(v, _join(path, i), depth + 1) for i, v in enumerate(value)]]
            items = []
            for k, v in value.items():
                if not isinstance(k, str):
                    raise WireError(f"{path or 'object'}: dict key {k!r} is not a str")
                items.append([k, self.node(v, _join(path, k), depth + 1)])
            return ["d", items]
        if not isinstance(value, (dict, list, str, int, float, bool, type(None))):
            raise WireError(f"{path or 'object'}: cannot encode a {type(value).__name__}")
        return ["j", value]


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise WireError(f"{what} is not JSON-serialisable: {exc}") from None


def _layout(obj: Any, metadata: dict | None) -> tuple[bytes, list[tuple[_Tensor, int]], int]:
    """Header bytes (length prefix included), tensors with their data offsets, data size."""
    encoder = _Encoder()
    try:
        tree = encoder.node(obj, "")
    except RecursionError:
        raise WireError(f"object nests deeper than {MAX_TREE_DEPTH} levels") from None
    tensors = encoder.tensors or {EMPTY_TENSOR_KEY: _Tensor("U8", [1], np.zeros(1, np.uint8))}
    meta = {STRUCTURE_KEY: _json({"v": WIRE_FORMAT_VERSION, "tree": tree}, "object")}
    if metadata:
        if not isinstance(metadata, dict):
            raise WireError("metadata must be a dict")
        meta[OP_METADATA_KEY] = _json(metadata, "metadata")
    # Same order as the safetensors writer: widest dtype first, so every tensor is aligned.
    ordered = sorted(tensors.items(), key=lambda kv: (-kv[1].itemsize, kv[0]))
    header: dict[str, Any] = {"__metadata__": meta}
    placed: list[tuple[_Tensor, int]] = []
    offset = 0
    for key, tensor in ordered:
        end = offset + tensor.raw.nbytes
        header[key] = {"dtype": tensor.code, "shape": tensor.shape, "data_offsets": [offset, end]}
        placed.append((tensor, offset))
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, placed, offset


def dumps(obj: Any, *, metadata: dict | None = None) -> bytes:
    """Encode ``obj`` (nested dict/list/tuple/JSON scalars with tensors anywhere) as one frame."""
    head, placed, data_size = _layout(obj, metadata)
    out, view = _allocate(len(head) + data_size)
    view[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    base = len(head)
    for tensor, offset in placed:
        np.copyto(view[base + offset : base + offset + tensor.raw.nbytes], tensor.raw)
    return out


def dumps_buffers(obj: Any, *, metadata: dict | None = None) -> list[memoryview]:
    """Encode ``obj`` without copying any tensor: the header, then one memoryview per tensor.

    Concatenated, the buffers are exactly ``dumps(obj, metadata=metadata)``. They alias the
    caller's tensors, so the tensors must not change until the buffers have been sent.
    """
    head, placed, _ = _layout(obj, metadata)
    return [memoryview(head)] + [memoryview(tensor.raw) for tensor, _ in placed]


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    code: str
    shape: list[int]
    begin: int
    end: int


@dataclass
class _Frame:
    buffer: memoryview
    data_start: int
    metadata: dict[str, str]
    entries: dict[str, _Entry]


def _as_buffer(data: Any) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"DSSST1 decoding expects bytes, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise WireError("DSSST1 decoding expects a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _bad_frame(buffer: memoryview, reason: str) -> WireError:
    head = bytes(buffer[:4])
    if head.startswith(_PICKLE_PREFIXES) or head.startswith(_ZIP_PREFIX):
        return WireError(
            "refusing to deserialize a legacy pickle/torch.save payload; "
            "the sender must use the DSSST1 (safetensors) wire format"
        )
    return WireError(f"not a valid DSSST1 safetensors payload: {reason}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(key: str, spec: Any, data_size: int) -> _Entry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {key!r} needs exactly dtype, shape and data_offsets")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str) or code not in _DTYPE_CODES:
        raise ValueError(f"tensor {key!r} has unsupported dtype {code!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"tensor {key!r} has an invalid shape {shape!r}")
    if len(shape) > MAX_TENSOR_DIMS:
        raise ValueError(
            f"tensor {key!r} has a shape of {len(shape)} dimensions (at most {MAX_TENSOR_DIMS})"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise ValueError(f"tensor {key!r} has invalid data_offsets {offsets!r}")
    if math.prod(shape) * _itemsize(code) != offsets[1] - offsets[0]:
        raise ValueError(f"tensor {key!r}: shape {shape} and {code} do not match its byte range")
    if math.prod(max(d, 1) for d in shape) * _itemsize(code) > _MAX_SHAPE_BYTES:
        raise ValueError(f"tensor {key!r} has a shape {_short(shape)} too large to index")
    return _Entry(code, shape, offsets[0], offsets[1])


class _Objects:
    """``object_pairs_hook`` of a frame header: counts its JSON objects as they are parsed (one
    per tensor, plus the header and ``__metadata__``) and stops the parse once they exceed
    :data:`MAX_FRAME_TENSORS`, so a header of millions of entries is refused after building at
    most the cap's worth of them."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict:
        self.count += 1
        if self.count > MAX_FRAME_TENSORS + 2:
            raise ValueError(
                f"header declares more than {MAX_FRAME_TENSORS} tensors, the most one frame may "
                f"hold (wire.MAX_FRAME_TENSORS)"
            )
        return dict(pairs)


def _parse_frame(data: Any) -> _Frame:
    buffer = _as_buffer(data)
    try:
        if len(buffer) < 8:
            raise ValueError(f"{len(buffer)} bytes is shorter than the 8-byte length prefix")
        (size,) = struct.unpack_from("<Q", buffer, 0)
        if size == 0 or size > MAX_HEADER_BYTES:
            raise ValueError(f"header length {size} is outside 1..{MAX_HEADER_BYTES}")
        if 8 + size > len(buffer):
            raise ValueError(f"header length {size} exceeds the {len(buffer)}-byte payload")
        try:
            header = json.loads(str(buffer[8 : 8 + size], "utf-8"), object_pairs_hook=_Objects())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ValueError("__metadata__ must map strings to strings")
        data_start = 8 + size
        data_size = len(buffer) - data_start
        entries = {key: _parse_entry(key, spec, data_size) for key, spec in header.items()}
        cursor = 0
        for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
            if entry.begin != cursor:
                raise ValueError("tensor data offsets do not tile the data buffer")
            cursor = entry.end
        if cursor != data_size:
            raise ValueError(
                f"tensors cover {cursor} of {data_size} data bytes (file not fully covered)"
            )
    except ValueError as exc:
        raise _bad_frame(buffer, str(exc)) from None
    return _Frame(buffer, data_start, metadata, entries)


def _structure(frame: _Frame) -> Any:
    text = frame.metadata.get(STRUCTURE_KEY)
    if text is None:
        raise WireError("frame has no DSSST1 structure metadata (__metadata__['dss'])")
    try:
        structure = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also an integer of 5,000 digits
        raise WireError(f"DSSST1 structure metadata is not valid JSON: {exc}") from None
    if not isinstance(structure, dict) or "tree" not in structure:
        raise WireError("DSSST1 structure metadata must be an object with a 'tree'")
    if structure.get("v") != WIRE_FORMAT_VERSION:
        raise WireError(
            f"unsupported DSSST1 wire version {structure.get('v')!r}; "
            f"expected {WIRE_FORMAT_VERSION!r}"
        )
    return structure["tree"]


class _Decoder:
    """Rebuilds the object from a structure tree, viewing tensors in place."""

    def __init__(self, frame: _Frame, tensor_type: TensorType) -> None:
        self.frame = frame
        self.used: set[str] = set()
        self.nodes = 0
        self.torch = None
        if tensor_type == "torch":
            from arctic_platform._extras import require

            self.torch = require("torch", "engine", purpose="decoding into torch tensors")
        elif tensor_type != "numpy":
            raise WireError(f"tensor_type must be 'numpy' or 'torch', got {tensor_type!r}")

    def tensor(self, key: Any, options: Any) -> Any:
        if not isinstance(key, str) or key not in self.frame.entries:
            raise WireError(f"structure tree references unknown tensor {key!r}")
        if key in self.used:
            raise WireError(f"structure tree references tensor {key!r} twice")
        self.used.add(key)
        entry = self.frame.entries[key]
        scalar = False
        if options is not None:
            if not isinstance(options, dict) or not isinstance(options.get("scalar", False), bool):
                raise WireError(f"tensor node {key!r} has invalid options {options!r}")
            scalar = options.get("scalar", False)
        if scalar and entry.shape != [1]:
            raise WireError(f"scalar tensor {key!r} must be stored with shape [1]")
        shape = () if scalar else tuple(entry.shape)
        if self.torch is not None and entry.code in _TORCH_CARRIER:
            dtype = _TORCH_CARRIER[entry.code]
        else:
            dtype = _numpy_dtype(entry.code)
        array = np.frombuffer(
            self.frame.buffer,
            dtype=dtype,
            count=math.prod(entry.shape),
            offset=self.frame.data_start + entry.begin,
        ).reshape(shape)
        if self.torch is None:
            return array
        tensor = self.torch.from_numpy(array)
        if entry.code in _TORCH_CARRIER:
            tensor = tensor.view(getattr(self.torch, _TORCH_DTYPE_NAMES[entry.code]))
        return tensor

    def node(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_TREE_DEPTH:
            raise WireError(f"structure tree nests deeper than {MAX_TREE_DEPTH} levels")
        self.nodes += 1
        if self.nodes > MAX_TREE_NODES:
            raise WireError(
                f"structure tree has more than {MAX_TREE_NODES} nodes, the most one frame may "
                "hold (wire.MAX_TREE_NODES)"
            )
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise WireError(f"malformed structure node {_short(node)}")
        tag = node[0]
        if tag == "t" and len(node) in (2, 3):
            return self.tensor(node[1], node[2] if len(node) == 3 else None)
        if tag == "j" and len(node) == 2:
            return node[1]
        if tag in ("l", "u") and len(node) == 2 and isinstance(node[1], list):
            items = [self.node(child, depth + 1) for child in node[1]]
            return items if tag == "l" else tuple(items)
        if tag == "d" and len(node) == 2 and isinstance(node[1], list):
            out: dict[str, Any] = {}
            for pair in node[1]:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise WireError(f"malformed dict entry {_short(pair)}")
                if pair[0] in out:
                    raise WireError(f"dict node repeats key {pair[0]!r}")
                out[pair[0]] = self.node(pair[1], depth + 1)
            return out
        if tag not in ("t", "j", "l", "u", "d"):
            raise WireError(f"unknown structure node tag {tag!r}")
        raise WireError(f"malformed {tag!r} structure node {_short(node)}")

    def check_all_used(self) -> None:
        unused = set(self.frame.entries) - self.used - {EMPTY_TENSOR_KEY}
        if unused:
            raise WireError(f"tensors not referenced by the structure tree: {sorted(unused)[:5]}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def loads(data: bytes | bytearray | memoryview, *, tensor_type: TensorType = "numpy") -> Any:
    """Decode one frame. Tensors are zero-copy views of ``data`` (see the module docstring).

    ``tensor_type="torch"`` returns torch tensors (requires torch); the default returns numpy
    arrays and works without torch.
    """
    return _decode(_parse_frame(data), tensor_type)


def loads_with_metadata(
    data: bytes | bytearray | memoryview, *, tensor_type: TensorType = "numpy"
) -> tuple[Any, dict]:
    """:func:`loads` and :func:`read_metadata` of one frame, parsing its header once."""
    frame = _parse_frame(data)
    return _decode(frame, tensor_type), _op_metadata(frame)


def _decode(frame: _Frame, tensor_type: TensorType) -> Any:
    tree = _structure(frame)
    decoder = _Decoder(frame, tensor_type)
    try:
        if decoder.torch is None:
            obj = decoder.node(tree)
        else:
            with warnings.catch_warnings():
                # Immutable input gives read-only arrays; the aliasing rule is documented above.
                warnings.filterwarnings("ignore", message=".*not writable.*")
                obj = decoder.node(tree)
    except RecursionError:
        raise WireError(f"structure tree nests deeper than {MAX_TREE_DEPTH} levels") from None
    decoder.check_all_used()
    return obj


def _op_metadata(frame: _Frame) -> dict:
    text = frame.metadata.get(OP_METADATA_KEY)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def header_bytes(data: bytes | bytearray | memoryview) -> int:
    """The size of a frame's JSON header as its length prefix declares it, once the frame is
    long enough to hold that header (0 otherwise: :func:`loads` says what is wrong). Lets a
    server hold a frame's JSON to its own limit before parsing any of it."""
    buffer = _as_buffer(data)
    if len(buffer) < 8:
        return 0
    (size,) = struct.unpack_from("<Q", buffer, 0)
    return size if 8 + size <= len(buffer) else 0


def read_metadata(data: bytes | bytearray | memoryview) -> dict:
    """The caller metadata of a frame, reading only its header; ``{}`` if absent or unreadable.

    Lenient on purpose (routing decisions peek at it); :func:`loads` is the authoritative check.
    """
    buffer = _as_buffer(data)
    try:
        frame = _parse_frame(buffer)
    except WireError:
        return {}
    return _op_metadata(frame)


# ----------------------------------------------------------------------------------------------
# byte chunks
# ----------------------------------------------------------------------------------------------


def _chunk_key(kind: str) -> str:
    if kind not in _CHUNK_KEYS:
        raise WireError(f"chunk kind must be 'request' or 'result', got {kind!r}")
    return _CHUNK_KEYS[kind]


def _chunk_frame(frame: np.ndarray, start: int, stop: int, key: str, desc: dict) -> bytes:
    return dumps({PAYLOAD_KEY: frame[start:stop]}, metadata={key: desc})


def encode_byte_chunks(
    frame: bytes | bytearray | memoryview,
    *,
    kind: str,
    operation: str | None = None,
    max_bytes: int = 0,
    chunk_group_id: str | None = None,
    force_chunk: bool = False,
) -> list[bytes]:
    """Split ``frame`` into self-describing chunk frames of at most ``max_bytes`` each.

    A frame that fits (or ``max_bytes <= 0``) is returned as ``[frame]`` unless ``force_chunk``,
    which wraps it as a single chunk so every logical request carries a ``chunk_group_id``.
    Request chunks carry ``chunk_group_id`` (a new uuid4 unless given); result chunks never do.
    """
    key = _chunk_key(kind)
    buffer = _as_buffer(frame)
    size = len(buffer)
    if not force_chunk and (max_bytes <= 0 or size <= max_bytes):
        return [frame if isinstance(frame, bytes) else bytes(buffer)]
    payload = np.frombuffer(buffer, dtype=np.uint8)
    base = {"frame_sha256": hashlib.sha256(buffer).hexdigest(), "frame_size_bytes": size}
    if kind == "request":
        base["chunk_group_id"] = chunk_group_id or str(uuid.uuid4())
    if operation is not None:
        base["operation"] = operation

    def build(step: int) -> list[bytes]:
        starts = range(0, size, step) if size else [0]
        total = len(starts)
        return [
            _chunk_frame(
                payload,
                start,
                min(start + step, size),
                key,
                {"chunk_idx": i, "total_chunks": total, **base},
            )
            for i, start in enumerate(starts)
        ]

    if max_bytes <= 0 or size <= max_bytes:
        return build(max(size, 1))
    # Start from the exact per-chunk overhead of the largest descriptor, then shrink if needed.
    worst = {"chunk_idx": size, "total_chunks": size, **base}
    overhead = len(dumps({PAYLOAD_KEY: np.zeros(0, np.uint8)}, metadata={key: worst})) + 8
    step = max_bytes - overhead
    if step < 1:
        raise WireError(f"max_bytes={max_bytes} is too small for a chunk (needs > {overhead})")
    while True:
        chunks = build(step)
        if all(len(c) <= max_bytes for c in chunks):
            return chunks
        if step == 1:
            raise WireError(f"max_bytes={max_bytes} is too small for a chunk")
        step = max(1, step // 2)


def _descriptor(frame: _Frame) -> tuple[str, dict] | None:
    op = _op_metadata(frame)
    found = [(kind, op[key]) for kind, key in _CHUNK_KEYS.items() if key in op]
    if not found:
        return None
    if len(found) > 1:
        raise WireError("frame carries both request and result chunk descriptors")
    kind, desc = found[0]
    if not isinstance(desc, dict):
        raise WireError(f"{kind} chunk descriptor is not an object")
    return kind, desc


def read_byte_chunk_metadata(frame: bytes | bytearray | memoryview) -> dict | None:
    """The chunk descriptor of ``frame`` with ``kind`` added, or None if it is not a chunk."""
    buffer = _as_buffer(frame)
    try:
        parsed = _parse_frame(buffer)
        found = _descriptor(parsed)
    except WireError:
        return None
    if found is None:
        return None
    kind, desc = found
    return {**desc, "kind": kind}


_GROUP_FIELDS = ("total_chunks", "frame_sha256", "frame_size_bytes", "chunk_group_id", "operation")


def _check_descriptor(kind: str, desc: dict) -> None:
    for name in ("chunk_idx", "total_chunks", "frame_size_bytes"):
        if not _is_int(desc.get(name)) or desc[name] < 0:
            raise WireError(f"chunk descriptor field {name!r} must be a non-negative int")
    if desc["total_chunks"] < 1 or desc["chunk_idx"] >= desc["total_chunks"]:
        raise WireError(f"chunk_idx {desc['chunk_idx']} is outside 0..{desc['total_chunks'] - 1}")
    sha = desc.get("frame_sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        raise WireError("chunk descriptor field 'frame_sha256' must be a sha256 hex digest")
    if kind == "request" and not isinstance(desc.get("chunk_group_id"), str):
        raise WireError("request chunk descriptor needs a string 'chunk_group_id'")
    if "operation" in desc and not isinstance(desc["operation"], str):
        raise WireError("chunk descriptor field 'operation' must be a string")


def decode_byte_chunks(
    chunks: Iterable[bytes | bytearray | memoryview], *, kind: str | None = None
) -> bytes:
    """Reassemble the original frame from its chunk frames, in any order.

    A single frame that is not a chunk is returned unchanged. Every chunk must belong to the same
    group; missing, duplicate or foreign chunks and a bad size or sha256 raise :class:`WireError`.
    """
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        raise WireError("decode_byte_chunks expects a list of chunk frames, not one frame")
    try:
        frames = list(chunks)
    except TypeError:
        raise WireError("decode_byte_chunks expects a list of chunk frames") from None
    if kind is not None:
        _chunk_key(kind)
    if not frames:
        raise WireError("no chunks to decode")
    parsed = [_parse_frame(frame) for frame in frames]
    descriptors = [_descriptor(frame) for frame in parsed]
    if len(frames) == 1 and descriptors[0] is None:
        return frames[0] if isinstance(frames[0], bytes) else bytes(parsed[0].buffer)
    if any(d is None for d in descriptors):
        raise WireError("a frame without chunk metadata was mixed into a chunk group")
    first_kind, first = descriptors[0]
    if kind is not None and first_kind != kind:
        raise WireError(f"expected {kind} chunks, got {first_kind} chunks")
    for chunk_kind, desc in descriptors:
        _check_descriptor(chunk_kind, desc)
        if chunk_kind != first_kind or any(desc.get(f) != first.get(f) for f in _GROUP_FIELDS):
            raise WireError("chunks belong to different frames or chunk groups")
    total = first["total_chunks"]
    if len(frames) != total:
        raise WireError(f"expected {total} byte chunks, got {len(frames)}")
    by_index: dict[int, np.ndarray] = {}
    for frame, (_, desc) in zip(parsed, descriptors, strict=True):
        if desc["chunk_idx"] in by_index:
            raise WireError(f"duplicate chunk_idx {desc['chunk_idx']}")
        body = _decode(frame, "numpy")
        payload = body.get(PAYLOAD_KEY) if isinstance(body, dict) else None
        if not (
            isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and payload.ndim == 1
        ):
            raise WireError(f"chunk {desc['chunk_idx']} has no 1-D uint8 payload")
        by_index[desc["chunk_idx"]] = payload
    size = sum(p.nbytes for p in by_index.values())
    if size != first["frame_size_bytes"]:
        raise WireError(f"chunks hold {size} bytes, descriptor says {first['frame_size_bytes']}")
    out, view = _allocate(size)
    cursor = 0
    for index in range(total):
        payload = by_index[index]
        view[cursor : cursor + payload.nbytes] = payload
        cursor += payload.nbytes
    if hashlib.sha256(out).hexdigest() != first["frame_sha256"]:
        raise WireError("reassembled frame does not match frame_sha256")
    return out


def encode_result_chunks(result: Any, *, max_bytes: int = 0) -> list[bytes]:
    """Encode ``result`` and split it into result chunks of at most ``max_bytes``."""
    return encode_byte_chunks(dumps(result), kind="result", max_bytes=max_bytes)


def decode_result_chunks(
    chunks: Iterable[bytes | bytearray | memoryview], *, tensor_type: TensorType = "numpy"
) -> Any:
    """Reassemble and decode result chunks."""
    return loads(decode_byte_chunks(chunks, kind="result"), tensor_type=tensor_type)
