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
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from arctic_platform.server.limits import ServerLimits

# What one accepted op costs beyond its body: its future, request record and queue entry.
OP_OVERHEAD_BYTES = 4096
# A number sent as JSON, counted as the 8 bytes of an array element (its Python object is larger;
# bodies of tensors arrive as DSSST1 arrays, counted exactly).
SCALAR_BYTES = 8
_SCALARS = frozenset({int, float, bool, type(None)})


def payload_nbytes(value: Any) -> int:
    """The bytes an op body holds: arrays (numpy, torch) by their buffers, strings and bytes by
    length, numbers as :data:`SCALAR_BYTES`, containers by what they hold. Iterative, so a deeply
    nested body cannot exhaust the stack; a list of numbers (token ids) is counted from its
    element types, gathered in C, not element by element."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            total += SCALAR_BYTES
        elif isinstance(item, (list, tuple)):
            if set(map(type, item)) <= _SCALARS:
                total += SCALAR_BYTES * len(item)
            else:
                stack.extend(item)
        elif kind is dict or isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (str, bytes, bytearray)):
            total += len(item)
        elif isinstance(nbytes := getattr(item, "nbytes", None), int):  # arrays, memoryviews
            total += nbytes
        else:
            total += SCALAR_BYTES
    return total


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
