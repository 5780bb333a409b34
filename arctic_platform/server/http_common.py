"""Pieces both HTTP APIs share: body reading, DSSST1 bodies, auth, errors.

A body is a claim until its bytes arrive: it is read into memory that grows with what has
arrived (a Content-Length above the limit is refused at once, but one below it allocates
nothing), within the read deadline, and a tenant has a bounded number of bodies being read at
once: bodies the server holds part of, waiting for the rest. A body that arrives whole with its
first bytes (every small request) was never partly held, so it takes no slot: a burst of small
requests (an RL loop's hundreds of single-sample requests) is never refused for it. A tenant's
long polls waiting at once are bounded the same way (:func:`long_poll`): each holds a connection.
``bytearray +=`` grows geometrically and large blocks are resized in place (realloc), so an
honest large upload still costs about one copy from the socket; DSSST1 frames are decoded
zero-copy from the result.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, TypeVar

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from arctic_platform import wire
from arctic_platform.server.auth import API_KEY_HEADER, PAT_TYPE_HEADER
from arctic_platform.server.errors import (
    BadRequest,
    ClientDisconnected,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
    result_of,
)
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.request_registry import finished_within

OCTET = "application/octet-stream"
T = TypeVar("T")


async def read_body(request: Request) -> bytearray:
    """The request body. Refused: above the server's ``max_body_bytes`` (413), not arrived
    within ``--body-read-timeout`` (408), beyond the tenant's ``--max-uploads-per-tenant``
    bodies being read (429). A client that goes away mid-body is :class:`ClientDisconnected`."""
    state = request.app.state
    limit: int = state.max_body_bytes
    declared = _declared_length(request, limit)
    if declared == 0:
        return bytearray()
    limits: ServerLimits = state.service.limits
    expected = "an unstated number of" if declared is None else f"{declared}"
    buffer = bytearray()
    with ExitStack() as slot:

        def partly_held() -> None:
            slot.enter_context(state.uploads.hold(caller_of(request), limits))

        try:
            # One task for the whole body (not one per chunk): the deadline costs nothing per
            # chunk. ``asyncio.TimeoutError`` is ``TimeoutError`` from Python 3.11 on.
            await asyncio.wait_for(
                _receive(request, buffer, limit, declared, partly_held), limits.body_read_timeout
            )
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"request body: {len(buffer)} of {expected} bytes arrived within the server's "
                f"read deadline of {limits.body_read_timeout} s (--body-read-timeout)",
                received=len(buffer),
            ) from None
        except ClientDisconnect:
            raise ClientDisconnected(
                f"client disconnected after {len(buffer)} of {expected} body bytes"
            ) from None
    if declared is not None and len(buffer) != declared:
        raise BadRequest(f"body has {len(buffer)} bytes, its Content-Length says {declared}")
    return buffer


async def _receive(
    request: Request,
    buffer: bytearray,
    limit: int,
    declared: int | None,
    partly_held: Callable[[], None],
) -> None:
    """Append the body to ``buffer`` as it arrives (what arrived is there if this is stopped),
    calling ``partly_held`` once, as soon as the server holds part of the body and waits for the
    rest (never when the first bytes are the whole body). A body sent chunked has no stated end,
    so it counts from its first bytes."""
    holding = False
    async for chunk in request.stream():
        buffer += chunk
        if len(buffer) > limit:
            raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
        if not holding and chunk and (declared is None or len(buffer) < declared):
            partly_held()
            holding = True


def _declared_length(request: Request, limit: int) -> int | None:
    """The body's Content-Length (None when it is sent chunked), 413 above ``limit``."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    try:
        size = int(declared)
    except ValueError:
        raise BadRequest("Content-Length is not an integer") from None
    if size > limit:
        raise PayloadTooLarge(f"body of {size} bytes exceeds the {limit}-byte limit")
    return size


class TenantSlots:
    """What each tenant has under way at once (request bodies being read, long polls waiting),
    bounded by ``check`` (a :class:`ServerLimits` method, given the count with the new one).
    Touched only on the event loop, so it needs no lock."""

    def __init__(self, check: Callable[[ServerLimits, int], None]) -> None:
        self._check = check
        self._held: collections.Counter = collections.Counter()

    def held(self, tenant: str | None) -> int:
        """How many ``tenant`` holds now."""
        return self._held[tenant]

    @contextmanager
    def hold(self, tenant: str | None, limits: ServerLimits) -> Iterator[None]:
        self._check(limits, self._held[tenant] + 1)
        self._held[tenant] += 1
        try:
            yield
        finally:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]


def long_poll(request: Request) -> AbstractContextManager:
    """A slot among the caller's long polls waiting at once, to hold while the route waits (429
    ``limit_exceeded`` beyond ``--max-long-polls-per-tenant``)."""
    state = request.app.state
    return state.long_polls.hold(caller_of(request), state.service.limits)


def close_unread_bodies(app):
    """ASGI middleware: an answer sent before its request's body was read whole closes the
    connection. Otherwise the server goes on reading (and dropping) the rest of the body for as
    long as the client takes to send it: a refused client claiming 255 MiB at a byte a minute
    would hold its connection for ever."""

    async def middleware(scope, receive, send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = dict(scope["headers"])
        unread = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers

        async def receive_tracked():
            nonlocal unread
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                unread = False
            return message

        async def send_closing(message) -> None:
            if unread and message["type"] == "http.response.start":
                closing = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": closing}
            await send(message)

        await app(scope, receive_tracked, send_closing)

    return middleware


# Bodies up to this size are decoded on the event loop (well under a millisecond); larger ones in
# a worker thread, so that decoding one tenant's large body never holds up another's requests.
DECODE_ON_LOOP_BYTES = 64 * 1024


async def off_loop(nbytes: int, decode: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``decode(*args, **kwargs)`` for a body of ``nbytes``: inline when small, else in a worker
    thread (see :data:`DECODE_ON_LOOP_BYTES`)."""
    if nbytes <= DECODE_ON_LOOP_BYTES:
        return decode(*args, **kwargs)
    return await run_in_threadpool(decode, *args, **kwargs)


async def op_result(service, sub, op: str, body: Any) -> Any:
    """Run ``op`` on ``sub`` and wait for its result on the event loop, not on a worker thread:
    a request holds a thread only while it submits, never while its op queues or runs, so many
    waiting requests (one tenant's ops queued behind its long one) cannot take the threads every
    other route, and every other tenant, runs on."""
    future = await run_in_threadpool(service.submit, sub, op, body)
    await finished_within(future, None)
    return result_of(future)


def decode_frame(body: bytes | bytearray, *, what: str, limits: ServerLimits) -> tuple[Any, dict]:
    """A DSSST1 body as numpy arrays (bf16 as ml_dtypes; the engines take either, so the
    server's edge needs no torch), and its op metadata: its header within
    ``--max-json-mb`` (413), a malformed frame a 400 naming the op. Synchronous: routes call it
    through :func:`frame_of`."""
    limits.check_json(f"{what}: DSSST1 header", wire.header_bytes(body))
    try:
        return wire.loads_with_metadata(body, tensor_type="numpy")
    except wire.WireError as exc:
        raise BadRequest(f"{what}: malformed DSSST1 body: {exc}") from None


def decode_json(body: bytes | bytearray, *, what: str, limits: ServerLimits) -> Any:
    """A JSON body (empty means None) within ``--max-json-mb`` (413); malformed JSON is a 400
    naming the op. Synchronous: routes call it through :func:`json_of`."""
    limits.check_json(what, len(body))
    if not body.strip():
        return None
    try:
        value = json.loads(body)
    except RecursionError:
        raise BadRequest(f"{what}: JSON body nests too deeply") from None
    except ValueError as exc:  # also bad UTF-8, and an integer of over 4,300 digits
        raise BadRequest(f"{what}: malformed JSON body: {exc}") from None
    if _SURROGATE_ESCAPE.search(body):
        _refuse_lone_surrogates(value, what)
    return value


# A JSON escape of a UTF-16 surrogate (``\ud800``): alone, not half of a pair, it decodes to a
# string that is no text (it cannot be encoded: a 500 wherever it is stored or written out).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value: Any, what: str) -> None:
    """A 400 naming the first string (or key) of ``value`` that holds a lone surrogate."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                stack.append((key, path))
                stack.append((inner, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((inner, f"{path}[{i}]") for i, inner in enumerate(item))
        elif isinstance(item, str) and not _is_text(item):
            field = path or "body"
            raise BadRequest(
                f"{what}: {field}: holds a lone UTF-16 surrogate escape, which is not text",
                field=field,
            )


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def frame_of(request: Request, body: bytes | bytearray, *, what: str) -> tuple[Any, dict]:
    """:func:`decode_frame`, off the event loop for a large body."""
    limits = request.app.state.service.limits
    return await off_loop(len(body), decode_frame, body, what=what, limits=limits)


async def json_of(request: Request, body: bytes | bytearray, *, what: str) -> Any:
    """:func:`decode_json`, off the event loop for a large body."""
    limits = request.app.state.service.limits
    return await off_loop(len(body), decode_json, body, what=what, limits=limits)


async def read_op_body(request: Request, *, what: str) -> tuple[Any, dict, int]:
    """``(body, frame metadata, bytes received)``, decoded by Content-Type: DSSST1 for
    ``application/octet-stream`` (its op metadata carries response options), JSON otherwise.
    The size tells the route whether submitting the body (validating it) belongs off the event
    loop too (:func:`off_loop`)."""
    body = await read_body(request)
    if OCTET in request.headers.get("content-type", ""):
        return (*await frame_of(request, body, what=what), len(body))
    return await json_of(request, body, what=what), {}, len(body)


def frame_response(value: Any) -> Response:
    return Response(content=wire.dumps(value), media_type=OCTET)


def owner_of(request: Request) -> str | None:
    """The caller's owner id (None when the server runs without tokens)."""
    auth = request.app.state.auth
    return auth.owner(request.headers.get("authorization"), request.headers.get(PAT_TYPE_HEADER))


def caller_of(request: Request) -> str | None:
    """The caller's owner id on any of the APIs: from Tinker's ``X-API-Key`` when the request
    carries one (the SDK's form of the same tokens), else from ``Authorization``."""
    key = request.headers.get(API_KEY_HEADER)
    if key:
        return request.app.state.auth.owner(f"Bearer {key}")
    return owner_of(request)


def service_error_response(_: Request, exc: ServiceError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())
