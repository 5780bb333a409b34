"""Tinker work that waits for a job to start, with no thread held per wait.

``create_model`` answers once its run's engines have loaded, ``load_weights`` into a new run
loads once they have, and a sample on a sampler whose job is still loading starts once it has:
a model can take minutes to load (a hub download), up to ``STARTUP_TIMEOUT_S``. Each of those
waits held a thread of one pool of eight that every tenant shared, so one tenant sampling a dozen
times on a model still loading held up every other tenant's ``create_model`` for as long. Here
one thread checks every waiting job's status each ``JOB_POLL_S`` (a dictionary lookup each) and,
once a job runs, calls what was waiting for it, which must not block (it answers a future or
queues an op on the job); a job that ends or is still starting at the deadline fails the wait
with the reason ``Service.running_job_info`` gives.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from arctic_platform.contract.states import STARTING_JOB_STATES
from arctic_platform.server.job_ops import JOB_POLL_S


@dataclass(eq=False)  # each wait is itself: compared and hashed by identity
class _Wait:
    job_id: str
    owner: str | None
    started: float
    deadline: float
    outer: Future  # what the client's future reads: failed here if the wait fails
    then: Callable[[], None]  # called once the job runs; must not block


class JobStarts:
    """Calls what waits for a job once the job runs (see the module doc)."""

    def __init__(self, service, *, timeout_s: float) -> None:
        self.service = service
        self.timeout_s = timeout_s
        self._waits: list[_Wait] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def then(self, job_id: str, owner: str | None, outer: Future, then: Callable[[], None]) -> None:
        """Call ``then()`` once ``job_id`` runs; ``outer`` gets the error instead if the job ends
        first, is still starting after ``timeout_s``, or ``then`` raises."""
        now = time.monotonic()
        wait = _Wait(job_id, owner, now, now + self.timeout_s, outer, then)
        with self._lock:
            if self._stop.is_set():
                outer.cancel()
                return
            self._waits.append(wait)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="tinker-job-starts", daemon=True
                )
                self._thread.start()

    def close(self) -> None:
        """Stop watching; what still waits is cancelled."""
        with self._lock:
            self._stop.set()
            waits, self._waits = self._waits, []
        for wait in waits:
            wait.outer.cancel()

    def _watch(self) -> None:
        while not self._stop.wait(JOB_POLL_S):
            with self._lock:
                waits = list(self._waits)
            done = {w for w in waits if self._settle(w)}
            if done:
                with self._lock:
                    self._waits = [w for w in self._waits if w not in done]

    def _settle(self, wait: _Wait) -> bool:
        """Whether ``wait`` is over: its job runs (``then`` called), ended, or timed out."""
        try:
            status = self.service.job_status(wait.job_id, owner=wait.owner)
            if status in STARTING_JOB_STATES and time.monotonic() < wait.deadline:
                return False
            waited = time.monotonic() - wait.started
            self.service.running_job_info(wait.job_id, owner=wait.owner, waited=waited)
            wait.then()
        except Exception as exc:  # the client's future reports it (NotFound: a forgotten job)
            with contextlib.suppress(InvalidStateError):  # cancelled by close meanwhile
                wait.outer.set_exception(exc)
        return True
