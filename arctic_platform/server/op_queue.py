"""A sub-job's op queue: arrival order, with generates that overlap on a batching sampler.

Ops on one sub-job start in the order they arrive. Most ops are *exclusive*: each runs alone,
after every op before it has finished, so an op always sees the effect of all earlier ones (a
``step`` after its ``forward-backward``, a ``generate`` after a weight sync). A *shared* op (a
``generate`` on a sampler that batches concurrent calls: ``engine.concurrent_generate``) may run
together with the shared ops around it, so that a request arriving while another decodes joins
that decode; it still starts only after every earlier exclusive op has finished, and a later
exclusive op (a weight sync, sleep, wake) waits until it has finished. So the order of
state-changing ops relative to generates is exactly as with one op at a time.

Shared ops that run together hold one of the server's op slots between them (:class:`SharedSlot`):
they are one engine's work, batched, and the slots bound engine work, not requests.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any


class OpQueue:
    """``submit(fn, *args, shared=...)`` runs ``fn`` on a thread of its own, in queue order
    (module doc)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._waiting: collections.deque[tuple[Future, Callable, tuple, bool]] = collections.deque()
        self._running = 0
        self._exclusive_running = False
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], *args: Any, shared: bool = False) -> Future:
        future: Future = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._waiting.append((future, fn, args, shared))
            self._start_ready()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new ops; with ``cancel_futures`` drop the queued ones (they end cancelled),
        otherwise they still run. With ``wait``, return once every op has ended."""
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                while self._waiting:
                    self._waiting.popleft()[0].cancel()
            if wait:
                while self._waiting or self._running:
                    self._cond.wait()

    def _start_ready(self) -> None:
        """Start the ops at the head of the queue that may run now (with the condition held)."""
        while self._waiting and not self._exclusive_running:
            future, fn, args, shared = self._waiting[0]
            if not shared and self._running:
                return
            self._waiting.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            self._running += 1
            self._exclusive_running = not shared
            threading.Thread(
                target=self._run, args=(future, fn, args), name=self.name, daemon=True
            ).start()

    def _run(self, future: Future, fn: Callable, args: tuple) -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            with self._cond:
                self._running -= 1
                self._exclusive_running = False
                self._start_ready()
                self._cond.notify_all()


class SharedSlot:
    """One server op slot shared by the shared ops of a sub-job that run together: the first
    to start takes it (waiting its turn among the tenants), the last to end gives it back."""

    def __init__(self, acquire: Callable[[], contextlib.AbstractContextManager]) -> None:
        self._acquire = acquire
        self._cond = threading.Condition()
        self._holders = 0
        self._held: contextlib.AbstractContextManager | None = None
        self._acquiring = False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._cond:
            self._holders += 1
            while self._acquiring:
                self._cond.wait()
            first = self._held is None
            self._acquiring = first
        if first:
            slot = self._acquire()
            try:
                slot.__enter__()
            except BaseException:  # e.g. cancelled while waiting: the next holder tries
                with self._cond:
                    self._holders -= 1
                    self._acquiring = False
                    self._cond.notify_all()
                raise
            with self._cond:
                self._held, self._acquiring = slot, False
                self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._holders -= 1
                release = self._held if self._holders == 0 else None
                if release is not None:
                    self._held = None
            if release is not None:
                release.__exit__(None, None, None)
