"""What the ``http`` and ``cortex`` transports share: streamed DSSST1 bodies, reading responses,
turning error responses and connection failures into the client's exceptions.

Large bodies are streamed as ~1 MiB memoryview pieces of :func:`arctic_platform.wire.dumps_buffers`
(no copy of any tensor) with an explicit ``Content-Length``: httpx posts one big ``bytes`` body
about 80x slower than the same body in pieces. The pieces are a list, so a retry can send them
again. Responses are read into one ``bytearray``, so decoded tensors are writable.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from tenacity import wait_exponential, wait_random

from arctic_platform import wire
from arctic_platform.client.errors import (
    ServerError,
    TransportError,
    bad_response,
    server_error,
)
from arctic_platform.contract.job_ops import JobStatus
from arctic_platform.contract.ops import OpName

OCTET = "application/octet-stream"
PIECE_BYTES = 1 << 20
log = logging.getLogger("arctic_platform.client")


def body_pieces(
    buffers: Sequence[memoryview | bytes], piece: int = PIECE_BYTES
) -> list[memoryview]:
    """``buffers`` cut into pieces of at most ``piece`` bytes (views, no copies)."""
    out = []
    for buffer in buffers:
        view = memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        for start in range(0, view.nbytes, piece):
            out.append(view[start : start + piece])
    return out


def octet_request(buffers: Sequence[memoryview | bytes]) -> tuple[list[memoryview], dict[str, str]]:
    """``(content, headers)`` for posting ``buffers`` as one octet body."""
    pieces = body_pieces(buffers)
    size = sum(p.nbytes for p in pieces)
    return pieces, {"Content-Type": OCTET, "Content-Length": str(size)}


def read_response(response: httpx.Response) -> bytearray:
    """The (streamed) response body in one writable buffer."""
    declared = response.headers.get("content-length")
    encoded = response.headers.get("content-encoding", "identity") != "identity"
    if declared is not None and declared.isdigit() and not encoded:
        buffer = bytearray(int(declared))
        view = memoryview(buffer)
        filled = 0
        for chunk in response.iter_bytes():
            end = filled + len(chunk)
            if end > len(buffer):
                raise TransportError("the response is longer than its Content-Length")
            view[filled:end] = chunk
            filled = end
        if filled != len(buffer):
            raise TransportError(f"the response ended after {filled} of {len(buffer)} bytes")
        return buffer
    buffer = bytearray()
    for chunk in response.iter_bytes():
        buffer += chunk
    return buffer


def decode_body(body: bytearray, content_type: str, tensor_type: str, *, op: str) -> Any:
    """DSSST1 for ``application/octet-stream``, JSON otherwise (empty means None)."""
    if OCTET in content_type:
        try:
            return wire.loads(body, tensor_type=tensor_type)
        except wire.WireError as exc:
            raise bad_response(f"malformed DSSST1 response: {exc}", op=op) from None
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_response(f"malformed JSON response: {exc}", op=op) from None


def answer_field(value: Any, name: str, op: str) -> Any:
    """Field ``name`` of a JSON answer; an answer without it is a ``bad_response``."""
    if not isinstance(value, dict) or name not in value:
        raise bad_response(f"the answer has no {name!r}: {str(value)[:200]}", op=op)
    return value[name]


def read_job_status(read: Callable[[Any], JobStatus], info: Any) -> JobStatus:
    """A job's info as the contract's ``JobStatus`` (``read``: the reader of the API's shape,
    ``JobStatus.from_info`` or ``from_onprem``); an unreadable one is a ``bad_response``."""
    try:
        return read(info)
    except ValueError as exc:
        raise bad_response(f"malformed job info: {exc}", op=OpName.GET_JOB) from None


def log_failed(response: httpx.Response, op: str) -> None:
    """Log a failed request with the server's request id, which its access log also records."""
    log.warning(
        "%s: %s %s answered %d (server request id %s)",
        op,
        response.request.method,
        response.request.url.path,
        response.status_code,
        response.headers.get("x-request-id", "none"),
    )


def error_from_response(status: int, body: bytes | bytearray, *, op: str) -> ServerError:
    """The client exception for an error response (``{"message","code"}`` or FastAPI bodies)."""
    try:
        parsed = json.loads(body) if body else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        parsed = {"message": bytes(body[:500]).decode("utf-8", "replace")}
    if not isinstance(parsed, dict):
        parsed = {"message": str(parsed)}
    return error_from_fields(status, parsed, op=op)


def error_from_fields(status: int, parsed: dict, *, op: str) -> ServerError:
    """The client exception for a parsed error body with its HTTP status (an HTTP answer, or a
    failed Cortex request's ``error_detail``)."""
    message = parsed.get("message")
    detail = parsed.get("detail")
    if message is None and detail is not None:
        message = detail if isinstance(detail, str) else json.dumps(detail)
    code = _find_code(parsed)
    if code is None and "chunk_group_id" in parsed and "missing chunks" in str(message):
        code = "chunk_group_missing_chunks"  # the older servers' form of this error
    details = {k: v for k, v in parsed.items() if k not in ("message", "code")}
    return server_error(status, code, str(message or f"HTTP {status}"), op=op, details=details)


def _find_code(value: Any, depth: int = 0) -> str | None:
    """The first string ``code`` in a nested error body (gateways wrap bodies in strings)."""
    if depth > 8:
        return None
    if isinstance(value, str) and value.startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if isinstance(value, dict):
        code = value.get("code")
        if isinstance(code, str):
            return code
        values = list(value.values())
    elif isinstance(value, list):
        values = value
    else:
        return None
    for item in values:
        found = _find_code(item, depth + 1)
        if found is not None:
            return found
    return None


def connection_error(exc: httpx.HTTPError, url: str, *, op: str) -> TransportError:
    """A :class:`TransportError` for an httpx failure, saying whether the op may have run."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return TransportError(f"{op}: cannot connect to {url}: {exc}")
    return TransportError(
        f"{op}: the connection to {url} failed after the request was sent ({type(exc).__name__}: "
        f"{exc}); the server may or may not have run it"
    )


def retry_wait(initial: float, maximum: float):
    """Exponential backoff from ``initial`` up to ``maximum`` seconds, plus up to ``initial`` of
    random jitter (so clients that failed together do not retry together)."""
    return wait_exponential(multiplier=initial, max=maximum) + wait_random(0, initial)
