"""Sampling jobs on a model (a base model or a saved ``sampler_weights`` checkpoint), shared by
every Tinker sampler one owner has on that model (and by its OpenAI-compatible requests,
:mod:`arctic_platform.server.openai`), at most :data:`MAX_MODEL_SAMPLING_JOBS` per owner.

The SDK has no call that releases a sampling client, and the cookbook's RL loop creates one on
each periodic checkpoint (``create_sampling_client(model_path=...)``) and uses it for one step;
kept until its session ended, every checkpoint would hold a loaded model. So an owner keeps its
most recently used model sampling jobs only: starting one more cancels (frees the engine of) the
least recently used one that has no sample in flight. A sampler whose job was released still
works: its next sample starts the job again and waits for the model to load, so a release costs
a reload, never an error. A job is also released when every session that used it has finished,
but not while another session's sample runs on it (:meth:`ModelSamplingJobs.after_finish`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from arctic_platform.contract.states import LIVE_JOB_STATES
from arctic_platform.server.errors import NotFound, ServiceError
from arctic_platform.server.service import Service
from arctic_platform.server.tinker.state import Session

# Loaded model sampling jobs one owner keeps (the least recently used idle one goes first).
MAX_MODEL_SAMPLING_JOBS = 2


@dataclass
class _Job:
    job_id: str
    in_flight: int = 0
    sessions: set[str] = field(default_factory=set)  # the live sessions that used it


def cancel_jobs(service: Service, job_ids: list[str], owner: str | None) -> None:
    """Cancel ``job_ids``; one that already ended (its session finished, it failed) has nothing
    left to free."""
    for job_id in job_ids:
        with contextlib.suppress(ServiceError):
            service.cancel_job(job_id, owner=owner)


class ModelSamplingJobs:
    """The owner-scoped, least-recently-used registry of model sampling jobs (see module doc)."""

    def __init__(self, service: Service, limit: int = MAX_MODEL_SAMPLING_JOBS) -> None:
        if limit < 1:
            raise ValueError(f"model sampling jobs per owner: must be >= 1, got {limit}")
        self.service = service
        self.limit = limit
        self._lock = threading.Lock()
        # (owner, model, sub-job kind) -> its job
        self._jobs: OrderedDict[tuple[str | None, str, str], _Job] = OrderedDict()

    def sub_job(
        self, session: Session | None, owner: str | None, model: str, kind: str = "sampling"
    ) -> str:
        """The ``kind`` sub-job (``sampling``, or ``log_prob`` for prompt scoring) on ``model``,
        started (for ``session``, which cancels it when it finishes; None: only the limit and
        the Service's idle expiry release it) if it has none running; it becomes the owner's
        most recently used."""
        with self._lock:
            job, released = self._use(session, owner, model, kind)
        cancel_jobs(self.service, released, owner)
        return f"{job.job_id}:{kind}:0"

    def begin(
        self, session: Session | None, owner: str | None, model: str, kind: str = "sampling"
    ) -> str:
        """:meth:`sub_job`, counting a sample in flight on it (not released until :meth:`end`)."""
        with self._lock:
            job, released = self._use(session, owner, model, kind)
            job.in_flight += 1
        cancel_jobs(self.service, released, owner)
        return f"{job.job_id}:{kind}:0"

    def end(self, owner: str | None, model: str, sub_job_id: str, kind: str = "sampling") -> None:
        """A sample that :meth:`begin` counted has finished."""
        with self._lock:
            job = self._jobs.get((owner, model, kind))
            if job is not None and sub_job_id.startswith(job.job_id + ":"):
                job.in_flight -= 1

    def jobs(self, owner: str | None) -> dict[str, str]:
        """The owner's model sampling jobs by model, least recently used first."""
        with self._lock:
            return {
                model: job.job_id
                for (o, model, kind), job in self._jobs.items()
                if o == owner and kind == "sampling"
            }

    def _use(
        self, session: Session | None, owner: str | None, model: str, kind: str
    ) -> tuple[_Job, list[str]]:
        """The job on ``model`` (started if none runs), made the most recently used, and the
        ids of the jobs dropped beyond the limit, which the caller cancels after the lock."""
        key = (owner, model, kind)
        job = self._jobs.get(key)
        if job is None or not self._alive(job.job_id, owner):
            info = self.service.create_job(
                {
                    "experiment_name": f"{kind} on {Path(model).name}",
                    "sub_job_configs": [{"job_type": kind, "model_name": model}],
                },
                owner=owner,
            )
            if session is not None:
                session.hold(
                    info["job_id"], lambda job_id: cancel_jobs(self.service, [job_id], owner)
                )
            job = self._jobs[key] = _Job(info["job_id"])
        if session is not None:
            job.sessions.add(session.session_id)
        self._jobs.move_to_end(key)
        return job, self._beyond_limit(owner)

    def after_finish(self, session: Session) -> tuple[set[str], list[str]]:
        """``session`` has finished: ``(kept, released)``, the ids of the model sampling jobs it
        used that stay (another live session used them, or a sample runs on them) and of those
        it was the last to use, now idle, which leave the registry for the caller to cancel."""
        kept, released = set(), []
        with self._lock:
            for key, job in list(self._jobs.items()):
                if session.session_id not in job.sessions:
                    continue
                job.sessions.discard(session.session_id)
                if job.sessions or job.in_flight:
                    kept.add(job.job_id)
                else:
                    released.append(self._jobs.pop(key).job_id)
        return kept, released

    def _beyond_limit(self, owner: str | None) -> list[str]:
        """Forget the owner's ended jobs, then drop its least recently used idle ones until it
        holds ``limit`` (the most recently used one is never dropped); their ids, to cancel.

        Cancelling closes engines (a vLLM process, Ray actors), which takes seconds: callers
        do it outside the lock (:func:`cancel_jobs`), so other samples are not held up by it."""
        mine = [key for key in self._jobs if key[0] == owner]
        for key in mine:
            if not self._alive(self._jobs[key].job_id, owner):
                del self._jobs[key]
        mine = [key for key in self._jobs if key[0] == owner]
        excess = len(mine) - self.limit
        dropped = []
        for key in mine[:-1]:
            if excess <= 0:
                break
            if self._jobs[key].in_flight:
                continue
            dropped.append(self._jobs.pop(key).job_id)
            excess -= 1
        return dropped

    def _alive(self, job_id: str, owner: str | None) -> bool:
        try:
            return self.service.job_status(job_id, owner=owner) in LIVE_JOB_STATES
        except NotFound:  # ended long ago and dropped from the owner's history
            return False
