"""Tinker futures: every op answers ``{request_id}`` at once and is polled with ``retrieve_future``.

An op's work is a :class:`concurrent.futures.Future` (usually one a Service sub-job queue returned).
``retrieve_future`` long-polls: it waits up to :data:`LONG_POLL_S` for the result and otherwise
answers HTTP 408 with a ``try_again`` body, which the SDK re-polls at once. The SDK's own
retrieve timeout is 45 s, so the long poll stays well inside it.

A failed op answers 200 ``{"error", "category"}``: ``user`` when the request was at fault (a
:class:`ServiceError` with a 4xx status), ``server`` otherwise; the SDK raises
``RequestFailedError`` with that category. Results stay retrievable after they were read (a client
whose poll response was lost polls again); past :data:`MAX_FINISHED` finished ones, the one that
finished first is dropped (kept in finishing order, so no op scans the store).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from arctic_platform.server.errors import NotFound, ServiceError, internal_error

LONG_POLL_S = 30.0
MAX_FINISHED = 10_000
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpResult:
    """A finished op's answer: a JSON body, or protobuf bytes for the types the SDK reads as
    protobuf (forward/backward outputs and samples)."""

    json: dict | None = None
    protobuf: bytes | None = None


@dataclass(frozen=True)
class _Entry:
    owner: str | None
    future: Future


class FutureStore:
    """Request ids -> futures of :class:`OpResult`, scoped by owner; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._finished: deque[str] = deque()

    def add(self, owner: str | None, future: Future) -> str:
        """Register ``future``; returns its new request id."""
        request_id = uuid.uuid4().hex
        with self._lock:
            self._entries[request_id] = _Entry(owner, future)
        future.add_done_callback(lambda _: self._finish(request_id))
        return request_id

    def completed(self, owner: str | None, result: OpResult) -> str:
        """Register an op that finished on the spot (answered without a queue)."""
        future: Future = Future()
        future.set_result(result)
        return self.add(owner, future)

    async def retrieve(self, request_id: str, owner: str | None) -> dict | OpResult | None:
        """The op's result, its ``{"error", "category"}`` body, or None if still running after
        the long poll. Unknown ids (or another owner's) are a 404."""
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None or entry.owner != owner:
            raise NotFound(f"request_id {request_id!r} not found")
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(entry.future)), LONG_POLL_S
            )
        except asyncio.TimeoutError:
            return None
        except ServiceError as exc:
            category = "user" if 400 <= exc.status < 500 else "server"
            return {"error": exc.message, "category": category}
        except Exception:  # an engine bug must reach the client, not kill the poll
            log.exception("Tinker request %s failed", request_id)
            return {"error": internal_error(request_id).message, "category": "server"}

    def _finish(self, request_id: str) -> None:
        with self._lock:
            self._finished.append(request_id)
            while len(self._finished) > MAX_FINISHED:
                del self._entries[self._finished.popleft()]
