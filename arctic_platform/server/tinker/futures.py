"""Tinker futures: every op answers ``{request_id}`` at once and is polled with ``retrieve_future``.

An op's work is a :class:`concurrent.futures.Future` (usually one a Service sub-job queue
returned), kept in the server's request registry (:mod:`arctic_platform.server.request_registry`,
as Cortex requests are: ids, owner scoping, bounded retention of finished ones and the mapping of
unanticipated errors live there). This module holds only Tinker's wire form of a poll:

* ``retrieve_future`` long-polls: it waits up to :data:`LONG_POLL_S` for the result and
  otherwise answers HTTP 408 with a ``try_again`` body, which the SDK re-polls at once. The
  SDK's own retrieve timeout is 45 s, so the long poll stays well inside it. A tenant's long
  polls waiting at once are bounded (``--max-long-polls-per-tenant``, 429 beyond it, which the
  SDK backs off from and retries).
* A result is protobuf for the types the SDK reads as protobuf (forward/backward outputs and
  samples), JSON otherwise (:class:`OpResult`).
* A failed op answers 200 ``{"error", "category"}``: ``user`` when the request was at fault (a
  :class:`ServiceError` with a 4xx status), ``server`` otherwise; the SDK raises
  ``RequestFailedError`` with that category.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from arctic_platform.server.errors import ServiceError, result_of
from arctic_platform.server.pending_work import payload_nbytes
from arctic_platform.server.request_registry import (
    RequestRegistry,
    TrackedRequest,
    finished_within,
    outcome,
)
from arctic_platform.server.tinker import codec, proto

LONG_POLL_S = 30.0
# Finished ops kept for retrieval (the one that finished first is dropped past this).
MAX_FINISHED = 10_000


@dataclass(frozen=True)
class OpResult:
    """A finished op's answer: a JSON body, or protobuf bytes for the types the SDK reads as
    protobuf (forward/backward outputs and samples)."""

    json: dict | None = None
    protobuf: bytes | None = None

    @property
    def nbytes(self) -> int:
        """What the answer holds, for the store's retention bound."""
        return payload_nbytes(self.json) + len(self.protobuf or b"")


def _answer_nbytes(request: TrackedRequest) -> int:
    """The bytes a finished request's answer holds (nothing for an error or a cancellation)."""
    future = request.future
    if future.cancelled() or future.exception() is not None:
        return 0
    return payload_nbytes(future.result())


class FutureStore:
    """The Tinker ops' futures of :class:`OpResult`, each retrievable by its owner only (past
    ``MAX_FINISHED`` finished ones, or ``max_finished_bytes`` of their answers, the first
    finished of the owner holding the most is dropped)."""

    def __init__(self, max_finished_bytes: int | None = None) -> None:
        self._requests: RequestRegistry[TrackedRequest] = RequestRegistry(
            MAX_FINISHED, max_finished_bytes, size=_answer_nbytes
        )

    def add(self, owner: str | None, future: Future) -> str:
        """Register ``future`` as an op of ``owner``; returns its new request id."""
        return self._requests.add(TrackedRequest(future=future), scope=owner).request_id

    async def retrieve(
        self,
        request_id: str,
        owner: str | None,
        waiting: Callable[[], AbstractContextManager] = nullcontext,
    ) -> Response:
        """The ``retrieve_future`` answer (module doc), holding ``waiting()`` while it waits (a
        slot among the tenant's long polls). An unknown id, or another owner's, is a 404."""
        future = self._requests.get(request_id, scope=owner).future
        if not future.done():
            with waiting():
                finished = await finished_within(future, LONG_POLL_S)
            if not finished:
                return JSONResponse(
                    status_code=408,
                    content={
                        "type": "try_again",
                        "request_id": request_id,
                        "queue_state": "active",
                    },
                )
        try:
            result: OpResult = outcome(request_id, lambda: result_of(future))
        except ServiceError as exc:
            category = "user" if 400 <= exc.status < 500 else "server"
            return JSONResponse({"error": exc.message, "category": category})
        if result.protobuf is not None:
            return Response(content=result.protobuf, media_type=proto.CONTENT_TYPE)
        return JSONResponse(codec.json_value(result.json))
