"""The request store every submit-then-poll API keeps: request ids -> submitted ops.

The Cortex API (:mod:`arctic_platform.server.async_requests`) and the Tinker API
(:mod:`arctic_platform.server.tinker.futures`) both answer a submitted op with a request id at
once and hand its outcome over later. What they share is here, so that the two differ only in
the form of their answers:

* a new request id per op, and its lookup, which answers 404 for an id outside the caller's
  scope (another tenant's or another job's) exactly as for an unknown one, so an id never tells
  a stranger that it exists;
* bounded retention: finished requests stay retrievable (a client whose poll response was lost
  polls again) until more than ``max_finished`` have finished, or their results (measured by
  the store's ``size``) hold more than ``max_finished_bytes``; then the one that finished first
  *in the scope holding the most* (requests, or bytes) is dropped: a tenant running thousands
  of quick ops, or keeping large results it never polls, drops its own old results, not
  another tenant's result that its client has yet to poll (with one queue for all, a tenant's
  4,096 quick ops dropped every other tenant's unpolled results, and 4,096 large results could
  fill the server's memory). The request that just finished is never the one dropped; requests
  still running are always kept; each scope keeps its finished ones in finishing order, so a
  drop scans the scopes, never the requests;
* the one mapping of an exception nobody anticipated onto ``internal_error(request_id)``, whose
  traceback is logged under that id (:func:`outcome`);
* waiting for an op's end with a timeout, for long polls (:func:`finished_within`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from arctic_platform.server.errors import NotFound, ServiceError, internal_error

log = logging.getLogger(__name__)
T = TypeVar("T")


def new_request_id() -> str:
    """A fresh request id (32 hex digits)."""
    return uuid.uuid4().hex


@dataclass(kw_only=True)
class TrackedRequest:
    """A submitted op: its request id and the future of its work. A surface that records more
    about its requests (Cortex's status, result and events) extends it."""

    future: Future = field(repr=False)
    request_id: str = field(default_factory=new_request_id)


R = TypeVar("R", bound=TrackedRequest)


class RequestRegistry(Generic[R]):
    """Requests by id, each visible to one scope; thread-safe (see module doc)."""

    def __init__(
        self,
        max_finished: int,
        max_finished_bytes: int | None = None,
        size: Callable[[R], int] | None = None,
    ) -> None:
        """``size``: the bytes a finished request holds, as its store keeps it (None: results
        are not measured, and only ``max_finished`` bounds them)."""
        self._lock = threading.Lock()
        self._requests: dict[str, tuple[str | None, R]] = {}
        # scope -> its finished requests in finishing order, with the bytes each holds
        self._finished: dict[str | None, deque[tuple[str, int]]] = {}
        self._scope_bytes: collections.Counter = collections.Counter()
        self._finished_count = 0
        self._finished_bytes = 0
        self._max_finished = max_finished
        self._max_finished_bytes = max_finished_bytes
        self._size = size

    def add(self, request: R, *, scope: str | None, settled: Future | None = None) -> R:
        """Register ``request``, which only ``scope`` may look up (a tenant, or a job whose
        owner the caller checked); ``request`` itself is returned. It counts as finished (and is
        measured) when ``settled`` is done: by default its future, or a future its store sets
        once it has recorded the outcome."""
        request_id = request.request_id
        with self._lock:
            self._requests[request_id] = (scope, request)
        done = request.future if settled is None else settled
        done.add_done_callback(lambda _: self._finish(request_id, request))
        return request

    def get(self, request_id: str, *, scope: str | None) -> R:
        """The request ``request_id`` of ``scope``; ``NotFound`` for any other id."""
        with self._lock:
            scope_and_request = self._requests.get(request_id)
        if scope_and_request is None or scope_and_request[0] != scope:
            raise NotFound(f"request {request_id!r} not found")
        return scope_and_request[1]

    def _finish(self, request_id: str, request: R) -> None:
        nbytes = 0 if self._size is None else self._size(request)  # outside the lock: a walk
        with self._lock:
            scope = self._requests[request_id][0]
            self._finished.setdefault(scope, deque()).append((request_id, nbytes))
            self._scope_bytes[scope] += nbytes
            self._finished_count += 1
            self._finished_bytes += nbytes
            # A result larger than the byte bound alone: dropping others cannot make room for
            # it, so it does not count (it goes at the next finish past the bound).
            limit = self._max_finished_bytes
            beyond = nbytes if limit is not None and nbytes > limit else 0
            while (rank := self._over(scope, beyond)) is not None:
                # the scope holding the most, among those with something besides this request
                held = [s for s, f in self._finished.items() if f[0][0] != request_id]
                if not held:
                    break
                self._drop_oldest(max(held, key=rank))

    def _over(self, scope: str | None, beyond: int) -> Callable[[str | None], int] | None:
        """How to rank the scopes when a bound is exceeded (bytes first), or None; ``beyond``:
        bytes of ``scope``'s newest result that count toward neither (lock held)."""
        limit = self._max_finished_bytes
        if limit is not None and self._finished_bytes - beyond > limit:
            return lambda s: self._scope_bytes[s] - (beyond if s == scope else 0)
        if self._finished_count > self._max_finished:
            return lambda s: len(self._finished[s])
        return None

    def _drop_oldest(self, scope: str | None) -> None:
        """Forget ``scope``'s first finished request (lock held)."""
        finished = self._finished[scope]
        request_id, nbytes = finished.popleft()
        del self._requests[request_id]
        self._finished_count -= 1
        self._finished_bytes -= nbytes
        self._scope_bytes[scope] -= nbytes
        if not finished:
            del self._finished[scope]
            del self._scope_bytes[scope]


def outcome(request_id: str, compute: Callable[[], T]) -> T:
    """``compute()``, which reads the op's outcome of request ``request_id``: its value, or its
    ``ServiceError``; any other exception is logged with its traceback under the request id and
    raised as ``internal_error(request_id)``, so that its class and text never reach the wire."""
    try:
        return compute()
    except ServiceError:
        raise
    except Exception:
        log.exception("request %s failed", request_id)
        raise internal_error(request_id) from None


async def finished_within(future: Future, timeout: float) -> bool:
    """Whether ``future`` finished (with a result or an error) within ``timeout`` seconds. The
    op goes on when the wait gives up: a long poll that times out is polled again."""
    # ``asyncio.wait`` neither raises the op's exception (nor its cancellation, a BaseException
    # here) nor cancels the op when it gives up.
    done, _ = await asyncio.wait({asyncio.wrap_future(future)}, timeout=timeout)
    return bool(done)
