"""Pieces both HTTP APIs share: body reading with a size limit, DSSST1 bodies, auth, errors.

Bodies are read straight into one preallocated buffer (no chunk list joined afterwards), and DSSST1
frames are decoded zero-copy from it, so a large upload costs one copy from the socket.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from arctic_platform import wire
from arctic_platform.server.auth import PAT_TYPE_HEADER
from arctic_platform.server.errors import BadRequest, PayloadTooLarge, ServiceError

OCTET = "application/octet-stream"


async def read_body(request: Request) -> bytearray:
    """The request body, refused with 413 above the server's ``max_body_bytes``."""
    limit: int = request.app.state.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest("Content-Length is not an integer") from None
        if size > limit:
            raise PayloadTooLarge(f"body of {size} bytes exceeds the {limit}-byte limit")
        buffer = bytearray(size)
        view = memoryview(buffer)
        filled = 0
        async for chunk in request.stream():
            end = filled + len(chunk)
            if end > size:
                raise BadRequest("body is longer than its Content-Length")
            view[filled:end] = chunk
            filled = end
        if filled != size:
            raise BadRequest(f"body ended after {filled} of {size} bytes")
        return buffer
    buffer = bytearray()
    async for chunk in request.stream():
        buffer += chunk
        if len(buffer) > limit:
            raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
    return buffer


def decode_frame(body: bytes | bytearray, *, what: str) -> Any:
    """A DSSST1 body as torch tensors; malformed frames are a 400 naming the op."""
    try:
        return wire.loads(body, tensor_type="torch")
    except wire.WireError as exc:
        raise BadRequest(f"{what}: malformed DSSST1 body: {exc}") from None


def decode_json(body: bytes | bytearray, *, what: str) -> Any:
    """A JSON body (empty means None); malformed JSON is a 400 naming the op."""
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"{what}: malformed JSON body: {exc}") from None


async def read_op_body(request: Request, *, what: str) -> tuple[Any, dict]:
    """``(body, frame metadata)``, decoded by Content-Type: DSSST1 for
    ``application/octet-stream`` (its op metadata carries response options), JSON otherwise."""
    body = await read_body(request)
    if OCTET in request.headers.get("content-type", ""):
        return decode_frame(body, what=what), wire.read_metadata(body)
    return decode_json(body, what=what), {}


def frame_response(value: Any) -> Response:
    return Response(content=wire.dumps(value), media_type=OCTET)


def owner_of(request: Request) -> str | None:
    """The caller's owner id (None when the server runs without tokens)."""
    auth = request.app.state.auth
    return auth.owner(request.headers.get("authorization"), request.headers.get(PAT_TYPE_HEADER))


def service_error_response(_: Request, exc: ServiceError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())
