"""The server's op slots, shared fairly between tenants.

At most ``total`` ops run at once across the server, and at most ``per_tenant`` of them for one
tenant, so one tenant's long ops always leave a slot for the others. When slots are scarce, the
waiting tenants are served in turn (round robin), each tenant's own ops in arrival order: a tenant
with many queued ops cannot push another tenant's single op back.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class _Ticket:
    tenant: str | None
    granted: bool = False


class FairSlots:
    """``with slots.slot(tenant):`` runs the body holding one of the server's op slots."""

    def __init__(self, total: int, per_tenant: int | None = None) -> None:
        if total < 1:
            raise ValueError(f"total slots must be at least 1, got {total}")
        self.total = total
        self.per_tenant = min(per_tenant or total, total)
        self._cond = threading.Condition()
        self._running: collections.Counter = collections.Counter()
        self._waiting: dict[str | None, collections.deque[_Ticket]] = {}
        self._turns: collections.deque[str | None] = collections.deque()

    @contextlib.contextmanager
    def slot(self, tenant: str | None) -> Iterator[None]:
        ticket = _Ticket(tenant)
        with self._cond:
            if tenant not in self._waiting:
                self._waiting[tenant] = collections.deque()
                self._turns.appendleft(tenant)  # not served lately: first in line
            self._waiting[tenant].append(ticket)
            self._grant()
            while not ticket.granted:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._running[tenant] -= 1
                self._grant()

    def queued(self) -> dict[str | None, int]:
        """How many ops of each tenant wait for a slot."""
        with self._cond:
            return {t: len(q) for t, q in self._waiting.items() if q}

    def running(self) -> int:
        with self._cond:
            return sum(self._running.values())

    def running_of(self, tenant: str | None) -> int:
        """How many of ``tenant``'s ops hold a slot."""
        with self._cond:
            return self._running[tenant]

    def _grant(self) -> None:
        """Hand free slots to waiting tenants in turn (called with the condition held)."""
        granted = False
        while sum(self._running.values()) < self.total:
            for tenant in self._turns:
                queue = self._waiting.get(tenant)
                if queue and self._running[tenant] < self.per_tenant:
                    queue.popleft().granted = True
                    self._running[tenant] += 1
                    self._turns.remove(tenant)  # served: to the back of the line
                    self._turns.append(tenant)
                    granted = True
                    break
            else:
                break  # every waiting tenant is at its own limit
        for tenant in [t for t, q in self._waiting.items() if not q and not self._running[t]]:
            del self._waiting[tenant]
            self._turns.remove(tenant)
        if granted:
            self._cond.notify_all()
