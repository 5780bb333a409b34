"""Finish Tinker sessions whose client went away without finishing them.

The SDK heartbeats its session every 10 s and finishes it when the script ends; a script that
crashed or was killed does neither, and its training and sampling jobs would hold their engines
(and the run's adapter snapshots) until the server stops. The reaper finishes every session whose
last heartbeat is older than the timeout, exactly as ``/sessions/{id}/finish`` would: its jobs
are cancelled (engines freed) and a late heartbeat gets 410, which tells the SDK it is gone.
Each sweep also runs ``sweep`` (the Tinker ops end the requests parked in runs whose job ended
on its own: they would wait for a ``seq_id`` that can no longer run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from arctic_platform.server.idle_reaper import IdleReaper
from arctic_platform.server.tinker.state import TinkerState

# Sessions silent this long are finished (the SDK heartbeats every 10 s).
SESSION_TIMEOUT_S = 120.0
log = logging.getLogger(__name__)


class SessionReaper(IdleReaper):
    """An :class:`IdleReaper` whose activity is a session's heartbeat."""

    def __init__(
        self,
        state: TinkerState,
        finish: Callable[[str, str | None], None],
        timeout_s: float = SESSION_TIMEOUT_S,
        sweep: Callable[[], None] | None = None,
    ) -> None:
        super().__init__("session timeout", timeout_s, self._finish_silent)
        self.state = state
        self.finish = finish
        self.sweep = sweep

    def _finish_silent(self, cutoff: float) -> list[str]:
        if self.sweep is not None:
            try:
                self.sweep()
            except Exception:  # it must not keep silent sessions from being finished
                log.exception("the sweep before finishing silent sessions failed")
        stale = [s for s in self.state.active_sessions() if s.last_heartbeat < cutoff]
        for session in stale:
            log.info("finishing Tinker session %s: no heartbeat", session.session_id)
            self.finish(session.session_id, session.owner)
        return [s.session_id for s in stale]
