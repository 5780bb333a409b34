"""Ending what its client abandoned: one daemon thread per kind of thing that can be left idle.

A client that goes away without saying so (a crash, a Ctrl-C, a dead notebook kernel) leaves its
server-side state holding engines. The server cannot tie that state to a connection (clients
reconnect on purpose), so it ends what has shown no sign of use for a timeout instead: Tinker
sessions without a heartbeat (``tinker/session_reaper.py``), jobs without an op (``serve
--job-idle-timeout``, :meth:`Service.expire_idle_jobs`). What counts as use, and what ending
means, belongs to the owner of the state; this module only holds the clock and the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class IdleReaper:
    """Calls ``expire(cutoff)`` every ``timeout / 4`` seconds (at most 10 s) on a daemon thread.

    ``expire`` ends everything whose last activity (``time.time()``) is older than ``cutoff`` and
    returns the ids it ended. ``what`` names the timeout in errors and logs.
    """

    def __init__(self, what: str, timeout_s: float, expire: Callable[[float], list[str]]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"{what}: must be > 0 seconds, got {timeout_s}")
        self.what = what
        self.timeout_s = timeout_s
        self.expire = expire
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        name = f"reaper-{self.what.replace(' ', '-')}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def reap(self, now: float | None = None) -> list[str]:
        """End what has been idle for longer than the timeout at ``now``; returns their ids."""
        return self.expire((time.time() if now is None else now) - self.timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 10.0)):
            try:
                self.reap()
            except Exception:  # one failed cancel must not stop later sweeps
                log.exception("%s: expiring idle state failed", self.what)
