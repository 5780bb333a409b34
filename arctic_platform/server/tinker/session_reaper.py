"""Finish Tinker sessions whose client went away without finishing them.

The SDK heartbeats its session every 10 s and finishes it when the script ends; a script that
crashed or was killed does neither, and its training and sampling jobs would hold their engines
(and the run's adapter snapshots) until the server stops. The reaper finishes every session whose
last heartbeat is older than the timeout, exactly as ``/sessions/{id}/finish`` would: its jobs
are cancelled (engines freed) and a late heartbeat gets 410, which tells the SDK it is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from arctic_platform.server.tinker.state import TinkerState

# Sessions silent this long are finished (the SDK heartbeats every 10 s).
SESSION_TIMEOUT_S = 120.0
log = logging.getLogger(__name__)


class SessionReaper:
    """A daemon thread that checks every ``timeout / 4`` (at most 10 s) for silent sessions."""

    def __init__(
        self,
        state: TinkerState,
        finish: Callable[[str, str | None], None],
        timeout_s: float = SESSION_TIMEOUT_S,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"session timeout: must be > 0 seconds, got {timeout_s}")
        self.state = state
        self.finish = finish
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tinker-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def reap(self, now: float | None = None) -> list[str]:
        """Finish the sessions silent for longer than the timeout; returns their ids."""
        cutoff = (time.time() if now is None else now) - self.timeout_s
        stale = [s for s in self.state.active_sessions() if s.last_heartbeat < cutoff]
        for session in stale:
            log.info("finishing Tinker session %s: no heartbeat", session.session_id)
            self.finish(session.session_id, session.owner)
        return [s.session_id for s in stale]

    def _run(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 10.0)):
            try:
                self.reap()
            except Exception:  # one failed cancel must not stop the reaping of the others
                log.exception("reaping stale Tinker sessions failed")
