"""Tinker request and result bodies <-> plain Python/numpy values.

Decoding checks what the engines cannot: chunk kinds, dtypes, shapes and sparse layouts, raising
:class:`BadRequest` naming the field (``data[3].loss_fn_inputs.weights``), so a malformed body
never reaches an engine. Encoding writes the protobuf results the SDK requires for ``forward``,
``forward_backward`` and ``sample``.

A tensor's declared shape is untrusted: a sparse tensor of a few bytes may declare gigabytes, and
dims may be negative or overflow a machine integer. So every shape is checked, in Python integers,
before anything of its size exists: a loss input holds one value, or one row, per ``model_input``
token of its datum (``[N]`` or ``[N, K]``, as the Tinker API defines them; anything else is a 400),
a dense tensor's values fill its shape exactly, and the dense bytes that a request's loss inputs
decode to may not exceed what the server accepts as a whole body (``serve --max-body-mb``), since
a sparse tensor is a compression of its dense form, not a way around the body limit (413
``limit_exceeded``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from arctic_platform.server.errors import BadRequest
from arctic_platform.server.limits import limit_exceeded
from arctic_platform.server.tinker import proto

_NUMPY_DTYPES = {proto.DTYPE_FLOAT32: np.float32, proto.DTYPE_INT64: np.int64}
# The serve flag whose body limit bounds what a request's loss inputs decode to (module doc).
BODY_LIMIT = "max_body_mb"


@dataclass(frozen=True)
class Datum:
    """One Tinker datum: its input tokens and its ``loss_fn_inputs`` as numpy arrays."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class ForwardBackwardRequest:
    """A parsed ``/api/v1/forward_backward`` body. ``data`` holds its datums as received;
    :func:`decode_data` decodes them as part of the op's validation, so that a refused datum uses
    up the request's ``seq_id`` like any other refusal."""

    model_id: str
    seq_id: int
    data: Sequence[Any]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    max_data_bytes: int
    nbytes: int  # the body's size, what the request holds until it ends


def decode_forward_backward(
    body: bytes | bytearray, *, max_data_bytes: int
) -> ForwardBackwardRequest:
    """Parse a protobuf ``ForwardBackwardRequest``; a malformed one is a 400. Its loss inputs may
    decode to at most ``max_data_bytes`` (the server's body limit, module doc)."""
    message = proto.ForwardBackwardRequest()
    try:
        message.ParseFromString(bytes(body))
    except DecodeError as exc:
        raise BadRequest(f"forward_backward: malformed protobuf body: {exc}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    return ForwardBackwardRequest(
        model_id=message.model_id,
        seq_id=int(message.seq_id),
        data=message.data,
        loss_fn=message.loss_fn,
        loss_fn_config=config,
        forward_only=bool(message.forward_only),
        max_data_bytes=max_data_bytes,
        nbytes=len(body),
    )


def decode_data(request: ForwardBackwardRequest) -> list[Datum]:
    """The request's datums as numpy arrays: 400 naming the field for a malformed one, 413 when
    its loss inputs would decode to more than ``request.max_data_bytes`` (checked before any of
    them is allocated)."""
    budget = _Budget(request.max_data_bytes)
    return [_datum(d, f"data[{i}]", budget) for i, d in enumerate(request.data)]


class _Budget:
    """The dense bytes a request's loss inputs may still decode to."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, nbytes: int, field: str) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise limit_exceeded(
                f"forward_backward: {field}: loss inputs decoding to {self.used} bytes exceed "
                f"this server's limit of {self.limit} bytes (the body limit)",
                limit=BODY_LIMIT,
                value=self.used,
                maximum=self.limit,
            )


def _datum(message, field: str, budget: _Budget) -> Datum:
    pieces = []
    for j, chunk in enumerate(message.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadRequest(
                f"{field}.model_input[{j}]: {kind or 'empty'} chunks are not supported; this "
                "server trains text models (encoded_text chunks)",
                field=f"{field}.model_input[{j}]",
            )
        pieces.append(_buffer(chunk.encoded_text.tokens, np.int32, f"{field}.model_input[{j}]"))
    tokens = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
    inputs = {
        name: tensor_to_numpy(t, f"{field}.loss_fn_inputs.{name}", tokens.size, budget)
        for name, t in message.loss_fn_inputs.items()
    }
    return Datum(tokens=tokens, inputs=inputs)


def tensor_to_numpy(message, field: str, tokens: int, budget: _Budget) -> np.ndarray:
    """A loss input ``Tensor`` of a datum of ``tokens`` tokens as a dense numpy array of its
    declared shape, every bound checked before it is allocated (module doc)."""
    dtype = _NUMPY_DTYPES.get(message.dtype)
    if dtype is None:
        raise BadRequest(
            f"{field}: unsupported dtype {message.dtype}; float32 or int64", field=field
        )
    shape = [int(s) for s in message.shape]
    if any(d < 0 for d in shape):
        raise BadRequest(f"{field}: shape {shape} has a negative dimension", field=field)
    if len(shape) not in (1, 2) or shape[0] != tokens:
        raise BadRequest(
            f"{field}: shape {shape} does not fit its datum: a loss input holds one value or one "
            f"row per model_input token, [{tokens}] or [{tokens}, K]",
            field=field,
        )
    count = math.prod(shape)
    nbytes = count * np.dtype(dtype).itemsize
    if message.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise BadRequest(
                f"{field}: a sparse tensor needs a 2-D shape, got {shape}", field=field
            )
        budget.take(nbytes, field)
        return _csr_to_dense(message.sparse_csr, dtype, shape, field)
    values = _buffer(message.dense, dtype, field)
    if values.size != count:
        raise BadRequest(f"{field}: {values.size} values do not fill shape {shape}", field=field)
    budget.take(nbytes, field)
    return values.reshape(shape)


def _csr_to_dense(csr, dtype, shape: list[int], field: str) -> np.ndarray:
    values = _buffer(csr.values, dtype, field)
    crow = _buffer(csr.crow_indices, np.int64, field)
    cols = _buffer(csr.col_indices, np.int64, field)
    rows, width = shape
    if (
        crow.size != rows + 1
        or cols.size != values.size
        or crow[0] != 0
        or crow[-1] != values.size
        or np.any(np.diff(crow) < 0)
        or np.any((cols < 0) | (cols >= width))
    ):
        raise BadRequest(f"{field}: inconsistent sparse CSR indices for shape {shape}", field=field)
    dense = np.zeros(shape, dtype=dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_of, cols] = values
    return dense


def _buffer(raw: bytes, dtype, field: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    if len(raw) % itemsize:
        raise BadRequest(
            f"{field}: {len(raw)} bytes are not whole {itemsize}-byte items", field=field
        )
    return np.frombuffer(raw, dtype=dtype).copy()


def encode_forward_backward_output(
    per_datum: Sequence[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """``ForwardBackwardOutput`` with one ``ArrayRecord`` holding every datum's outputs."""
    message = proto.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    message.metrics.update({k: float(v) for k, v in metrics.items()})
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(per_datum))
    names = per_datum[0].keys() if per_datum else ()
    for name in names:
        arrays = [np.ascontiguousarray(d[name], dtype=np.float32) for d in per_datum]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
        batched.dtype = proto.DTYPE_FLOAT32
    return message.SerializeToString()


@dataclass(frozen=True)
class SampledSequence:
    """One sampled sequence of a ``SampleResponse``."""

    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str


def encode_sample_response(
    sequences: Sequence[SampledSequence],
    prompt_logprobs: list[float | None] | None,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """``SampleResponse``; a prompt position without a log-prob is NaN on the wire.
    ``prompt_cache_hit_tokens``: the prompt tokens the engine's prompt cache provided."""
    message = proto.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for seq in sequences:
        item = message.sequences.add(
            stop_reason=proto.STOP_REASON[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
        )
        if seq.logprobs is not None:
            item.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return message.SerializeToString()


def json_value(value: Any) -> Any:
    """``value`` with numpy scalars turned into Python numbers (for JSON results)."""
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
