"""A sub-job's op queue: ops run in arrival order, one at a time, except ``generate`` side by side.

A sampling engine with a running batch (our sampler's ``concurrent_generate``) decodes the
generate calls that reach it together, a late one joining at the next decode step; a queue that
ran them one at a time would make every generate wait for the one before it. So ops enter as
*shared* (generates on such an engine) or *exclusive* (everything else: weight loads, sleep,
checkpoints, ...), as readers and writers do: shared ops start while only shared ops run,
an exclusive op starts once everything before it has finished and runs alone, and nothing that
arrived after an op waiting at the head of the queue starts before it. Arrival order between a
weight sync and the generates around it is therefore kept, as with one worker thread.

The interface is the part of ``ThreadPoolExecutor`` the Service uses (``submit``,
``shutdown(wait, cancel_futures)``), so the registry, the drain and the executor treat it alike.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass
class _Entry:
    future: Future
    fn: Callable[..., Any]
    args: tuple
    shared: bool


class SubJobQueue:
    """See the module doc; ``name`` names its threads. At most ``max_shared`` shared ops run at
    once (one thread each): the most op slots the job's owner can hold, so more could only wait
    for a slot, and those that wait here stay cancellable and hold no thread."""

    def __init__(self, name: str, *, max_shared: int = 1) -> None:
        if max_shared < 1:
            raise ValueError(f"max_shared must be at least 1, got {max_shared}")
        self.name = name
        self.max_shared = max_shared
        self._lock = threading.Lock()
        self._waiting: deque[_Entry] = deque()
        self._running: set[threading.Thread] = set()
        self._running_exclusive = False
        self._shut = False

    def submit(self, fn: Callable[..., Any], *args: Any, shared: bool = False) -> Future:
        """Queue ``fn(*args)``; ``shared`` ops may run beside each other (module doc)."""
        future: Future = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._waiting.append(_Entry(future, fn, args, shared))
            self._start_ready()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new ops; ``cancel_futures`` drops the queued ones; ``wait`` joins the ops
        running now (unlike ThreadPoolExecutor, not the queued ones started after: every caller
        here cancels those first, or does not wait)."""
        with self._lock:
            self._shut = True
            if cancel_futures:
                while self._waiting:
                    self._waiting.popleft().future.cancel()
            running = list(self._running)
        if wait:
            for thread in running:
                if thread is not threading.current_thread():
                    thread.join()

    def _start_ready(self) -> None:
        """Start the ops at the head that may run now (under the lock)."""
        while self._waiting and not self._running_exclusive:
            head = self._waiting[0]
            if self._running and (not head.shared or len(self._running) >= self.max_shared):
                return
            self._waiting.popleft()
            if not head.future.set_running_or_notify_cancel():
                continue
            self._running_exclusive = not head.shared
            # Not a daemon (as ThreadPoolExecutor's workers): the interpreter waits for an op
            # to end at its next stop point rather than tearing torch down under it.
            thread = threading.Thread(target=self._run, args=(head,), name=f"{self.name}-op")
            self._running.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: this op fails, the queue goes on
                self._running.discard(thread)
                self._running_exclusive = False
                head.future.set_exception(exc)

    def _run(self, entry: _Entry) -> None:
        try:
            result = entry.fn(*entry.args)
        except BaseException as exc:
            entry.future.set_exception(exc)
        else:
            entry.future.set_result(result)
        finally:
            with self._lock:
                self._running.discard(threading.current_thread())
                if not entry.shared:
                    self._running_exclusive = False
                self._start_ready()
