"""What each tenant has submitted and not seen finish, in bytes, bounded per tenant.

An op holds its body from the moment the server accepts it until it ends: while it waits in its
sub-job's queue, while a Tinker op waits for its ``seq_id``'s turn, and while it runs. Every
other bound is per request or per connection, so without this one a tenant could submit op after
op (a 50 MB batch each, or Tinker requests numbered far ahead that never get their turn) until
the server ran out of memory, taking every tenant's jobs with it. ``--max-pending-mb-per-tenant``
bounds the sum: an op beyond it waits for none of the others and is refused at once (429, which
clients retry; 413 for an op larger than the bound alone), before it is queued, so a refused op
never runs and changes nothing.

Every surface takes its ops' bytes here: ``Service.submit`` (on-prem, Cortex, OpenAI, in-process
and Ray) and the Tinker API's own queueing (``tinker/operations.py``). An op's size is
:func:`payload_nbytes` of its body plus :data:`OP_OVERHEAD_BYTES`, so a flood of empty ops is
bounded too.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from arctic_platform.server.limits import ServerLimits

# What one accepted op costs beyond its body: its future, request record and queue entry.
OP_OVERHEAD_BYTES = 4096
_SCALARS = frozenset({int, float, bool, type(None)})
# A number object of magnitude below 2**30 (every float, most ints) takes at most this many bytes.
_SMALL_NUMBER = 1 << 30
_SMALL_NUMBER_BYTES = max(sys.getsizeof(_SMALL_NUMBER - 1), sys.getsizeof(0.0))


def payload_nbytes(value: Any) -> int:
    """The bytes an op body holds in memory: arrays (numpy, torch) and memoryviews by their
    buffers, every other object at its own size (``sys.getsizeof``: a list's header and
    pointers, a dict's table, a string's header and text, a number's object), containers plus
    what they hold. A parsed JSON body costs several times its text (a token id in a list 36
    bytes, an empty list 56), and a free-form field (a training op's ``meta``) can hold any
    shape, so the count follows the objects, not the text: otherwise a body of empty containers
    would count as nothing while holding gigabytes. Iterative, so a deeply nested body cannot
    exhaust the stack; a list of numbers (token ids) is measured in C, not element by element
    in Python. An object two containers share is counted twice (never less than it holds)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(nbytes := getattr(item, "nbytes", None), int):  # arrays, memoryviews
            total += nbytes
            continue
        total += sys.getsizeof(item)
        if isinstance(item, (list, tuple)):
            if set(map(type, item)) <= _SCALARS:
                total += _scalars_nbytes(item)
            else:
                stack.extend(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
    return total


def _scalars_nbytes(items: list | tuple) -> int:
    """The objects of a list of numbers, bools and Nones: when every one is a number below
    2**30 in magnitude (``min`` and ``max`` check it in C) each is counted at the most such a
    number takes; otherwise (a larger int grows with its digits) each is measured."""
    try:
        small = min(items) > -_SMALL_NUMBER and max(items) < _SMALL_NUMBER
    except (TypeError, ValueError):  # a None among them, or no items
        small = False
    if small:
        return len(items) * _SMALL_NUMBER_BYTES
    return sum(map(sys.getsizeof, items))


class PendingWork:
    """Each tenant's bytes in ops accepted and not finished (see the module doc). Thread-safe:
    ops are accepted on worker threads and end on queue threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: collections.Counter = collections.Counter()

    def held(self, tenant: str | None) -> int:
        """The bytes ``tenant``'s unfinished ops hold now."""
        with self._lock:
            return self._held[tenant]

    def take(self, tenant: str | None, nbytes: int, limits: ServerLimits) -> Callable[[], None]:
        """Count an op of ``nbytes`` (body bytes; the overhead is added here) for ``tenant``,
        or refuse it (``ServerLimits.check_pending``). Returns the release, to call once the op
        has ended or was never queued: :meth:`until` does it when a future ends; a second call
        does nothing."""
        nbytes += OP_OVERHEAD_BYTES
        with self._lock:
            limits.check_pending(self._held[tenant], nbytes)
            self._held[tenant] += nbytes
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                self._held[tenant] -= nbytes
                if not self._held[tenant]:
                    del self._held[tenant]

        return release

    @staticmethod
    def until(future: Future, release: Callable[[], None]) -> Future:
        """``release`` once ``future`` ends (at once if it has); returns ``future``."""
        future.add_done_callback(lambda _: release())
        return future
