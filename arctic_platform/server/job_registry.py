"""The jobs a server knows: their sub-jobs, states and logs, mirrored to SQLite.

One registry per Service, one lock over every job and sub-job field the other parts read or
change (the op executor, the job builder, the checkpoint catalogue, the shutdown drain), so a
job is never seen half-way through a change. Every state change is written to the metadata store
(``store.py``) at once: a restarted server lists the jobs of earlier runs, and the ones that were
alive are ``terminated`` there (:meth:`JobRegistry.restore`).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from arctic_platform.contract.engine_protocols import AnyEngine
from arctic_platform.contract.job_config import (
    API_JOB_TYPE,
    SHORT_JOB_TYPE,
    CreateJobRequest,
    SubJobConfig,
)
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.states import TERMINAL_JOB_STATES, JobState
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.server.errors import BadRequest, Conflict, NotFound
from arctic_platform.server.paths import PathPolicy
from arctic_platform.server.store import MetadataStore
from arctic_platform.server.sub_job_queue import SubJobQueue
from arctic_platform.server.tenant_quota import TenantQuota

LOG_LINES_PER_JOB = 2000
# Ended jobs a tenant's history keeps (the newest), besides those that saved checkpoints, which
# are kept while the checkpoints are: a job that fails at once (a model folder that holds no
# model) can be created in a loop, and each would otherwise stay in memory and the store for good.
MAX_ENDED_JOBS_PER_TENANT = 1000


@dataclass
class SubJob:
    """One engine of a job and the queue its ops run on."""

    sub_job_id: str
    job_id: str
    kind: str
    spec: SubJobConfig
    status: JobState = "pending"
    # The engine of ``kind``'s Protocol (contract/engine_protocols.py); None until it is built
    # and once it is released.
    engine: AnyEngine | None = None
    queue: SubJobQueue | None = None
    # What the engine loads: ``spec.model_name`` checked against the owner's space (see paths.py).
    model_path: str | None = None
    # Settings the engine could not honour here (a GPU-stack attention, LoRA on a tied output
    # layer), and what it ran instead (the engine's ``setting_fallbacks``): reported with the
    # spec's ignored settings.
    fallbacks: dict[str, str] = field(default_factory=dict)

    def info(self) -> dict:
        settings = self.spec.training_config or self.spec.inference_config
        key = "training_config" if self.kind == "training" else "inference_config"
        return {
            "sub_job_id": self.sub_job_id,
            "job_type": API_JOB_TYPE[self.kind],
            "status": self.status,
            "model_name": self.spec.model_name,
            key: settings.model_dump(mode="json", by_alias=True) if settings else None,
            "ignored_settings": {**self.spec.ignored_settings, **self.fallbacks},
        }


@dataclass
class Job:
    """A job: its sub-jobs, owner, state and a log of what happened to it."""

    job_id: str
    owner: str | None
    request: dict
    experiment_name: str | None
    sub_jobs: list[SubJob]
    status: JobState = "pending"
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    logs: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=LOG_LINES_PER_JOB)
    )
    log_offset: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Stops the job's ops in flight (job cancelled, server draining); see engine/cancellation.py.
    stop: CancelToken = field(default_factory=CancelToken)
    # Ops submitted and not yet finished (what a shutdown drains).
    in_flight: set = field(default_factory=set)
    # The op that ran most recently on any sub-job, and when it started (what an operator asks
    # first about a job that looks stuck).
    last_op: str | None = None
    last_op_at: float | None = None
    # When the job last showed its owner's use (an op submitted or finished, a poll of one):
    # what the idle expiry measures from.
    last_active_at: float = field(default_factory=time.time)
    # Bytes of model weights the job's engines load (what --max-model-bytes-per-tenant counts).
    model_bytes: int = 0

    def info(self) -> dict:
        return {
            "job_id": self.job_id,
            "status": self.status,
            "reason": self.reason,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "experiment_name": self.experiment_name,
            "image_tag": "arctic-platform",
            "last_op": self.last_op,
            "last_op_at": self.last_op_at,
            "sub_jobs": [s.info() for s in self.sub_jobs],
        }


class JobRegistry:
    """The jobs by id, their state changes (each persisted while the job is kept: an owner's
    oldest ended jobs are dropped, :meth:`_forget_old_ended`), logs and engine release.

    ``lock`` (re-entrant) guards the table and every job's mutable fields; the other parts of
    the Service take it for changes that must look atomic (an op entering a queue, a shutdown
    closing the registry and listing the builds under way).
    """

    def __init__(self, store: MetadataStore, paths: PathPolicy, quota: TenantQuota) -> None:
        self.store = store
        self.paths = paths
        self.quota = quota
        self.lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
        # Set by a shutdown: no job is added after it.
        self.closed = False

    # -- the table --------------------------------------------------------------------------

    def add(self, job: Job) -> None:
        """Register a new ``job`` (a 409 once the server shuts down, or over its owner's
        quota), log its creation and persist it."""
        with self.lock:
            if self.closed:
                raise Conflict("the server is shutting down")
            self.check_quota(job)
            self._jobs[job.job_id] = job
            for old in self._forget_old_ended(job.owner):
                self.store.delete_job(old.job_id)
        self.log(job, f"created with {len(job.sub_jobs)} sub-job(s)")
        self.persist(job)

    def _forget_old_ended(self, owner: str | None) -> list[Job]:
        """Drop the owner's oldest ended jobs past :data:`MAX_ENDED_JOBS_PER_TENANT`; the jobs
        dropped, whose store rows the caller deletes under the lock. A dropped id is a 404 from
        then on, like an unknown one. Not counted nor dropped: a job with catalogued checkpoints (a
        checkpoint's record names its job, which owns it), and one still winding down (an op
        in flight, such as a save that may yet catalogue a checkpoint, or engines not yet
        released)."""
        ended = [
            j
            for j in self._jobs.values()  # oldest first: the table is in creation order
            if j.owner == owner
            and j.status in TERMINAL_JOB_STATES
            and not j.in_flight
            and all(s.engine is None for s in j.sub_jobs)
        ]
        if len(ended) <= MAX_ENDED_JOBS_PER_TENANT:  # the usual case: no store query
            return []
        saved = self.store.jobs_with_checkpoints()
        ended = [j for j in ended if j.job_id not in saved]
        forgotten = ended[: max(0, len(ended) - MAX_ENDED_JOBS_PER_TENANT)]
        for job in forgotten:
            del self._jobs[job.job_id]
        return forgotten

    def close(self) -> list[Job]:
        """Refuse new jobs from now on; every job known (the caller holds the lock)."""
        self.closed = True
        return list(self._jobs.values())

    def all(self) -> list[Job]:
        """Every job known, of every owner (a snapshot)."""
        with self.lock:
            return list(self._jobs.values())

    def find(self, job_id: str) -> Job | None:
        """The job ``job_id`` exactly, whoever owns it, or None."""
        with self.lock:
            return self._jobs.get(job_id)

    def get(self, job_id: str, owner: str | None, *, check_owner: bool = True) -> Job:
        """The job of ``job_id`` (or of the sub-job id ``job_id``); NotFound unless ``owner``
        owns it, so another tenant's job looks the same as one that does not exist."""
        job = self.find(parent_of(job_id))
        if job is None or (check_owner and job.owner != owner):
            raise NotFound(f"job {job_id!r} not found")
        return job

    def resolve(self, job_or_sub_id: str, *, owner: str | None, kind: str | None = None) -> SubJob:
        """A sub-job by id, or the one sub-job of ``kind`` in job ``job_or_sub_id``."""
        job_id = parent_of(job_or_sub_id)
        job = self.get(job_id, owner)
        if ":" in job_or_sub_id:
            for sub in job.sub_jobs:
                if sub.sub_job_id == job_or_sub_id:
                    if kind is not None and sub.kind != kind:
                        raise BadRequest(
                            f"sub-job {job_or_sub_id} is a {sub.kind} sub-job; this op needs "
                            f"a {kind} sub-job",
                            code="wrong_job_type",
                        )
                    return sub
            raise NotFound(f"sub-job {job_or_sub_id!r} not found")
        matches = [s for s in job.sub_jobs if kind is None or s.kind == kind]
        if not matches:
            raise BadRequest(
                f"job {job_id} has no {kind} sub-job for this op", code="wrong_job_type"
            )
        return matches[0]

    def require_running(self, job: Job) -> None:
        if job.status != "running":
            detail = f": {job.reason}" if job.reason else ""
            raise Conflict(f"job {job.job_id} is {job.status}{detail}", code=f"job_{job.status}")

    def check_quota(self, job: Job) -> None:
        """Refuse ``job`` if its owner would hold more live jobs or model bytes than the quota
        allows, counting ``job`` (under the lock, so concurrent creates count each other)."""
        live = [
            j
            for j in self._jobs.values()
            if j.owner == job.owner and j.status not in TERMINAL_JOB_STATES and j is not job
        ]
        self.quota.check(
            jobs=len(live) + 1, model_bytes=sum(j.model_bytes for j in live) + job.model_bytes
        )

    # -- logs -------------------------------------------------------------------------------

    def log(self, job: Job, line: str) -> None:
        """Add ``line`` to the job's log, which its owner reads (paths redacted)."""
        line = self.paths.redact(job.owner, line)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        with self.lock:
            if len(job.logs) == job.logs.maxlen:
                job.log_offset += 1
            job.logs.append(f"{stamp} {line}")

    def tail_logs(
        self, job_id: str, *, owner: str | None = None, cursor: Any = None, max_lines: int = 200
    ) -> dict:
        """Lines logged for a job since ``cursor`` (an opaque position this method returned)."""
        job = self.get(job_id, owner)
        with self.lock:
            start = job.log_offset if cursor in (None, "") else _int(cursor, "cursor")
            start = max(start, job.log_offset)
            lines = list(job.logs)[start - job.log_offset : start - job.log_offset + max_lines]
            end = start + len(lines)
            return {
                "entries": lines,
                "next_cursor": str(end),
                "eof": job.status in TERMINAL_JOB_STATES and end >= job.log_offset + len(job.logs),
            }

    # -- state changes ----------------------------------------------------------------------

    def set_status(self, job: Job, status: JobState, reason: str | None) -> None:
        if reason is not None:
            reason = self.paths.redact(job.owner, reason)
        with self.lock:
            job.status = status
            job.reason = reason
            job.updated_at = time.time()
        self.log(job, f"status {status}" + (f": {reason}" if reason else ""))
        self.persist(job)

    def cancel(self, job: Job, reason: str) -> None:
        """Mark ``job`` cancelled and stop its ops (the caller holds the lock, then releases
        the engines)."""
        job.cancelled.set()
        job.stop.cancel(f"job {job.job_id} was cancelled")
        self.set_status(job, "cancelled", reason)

    def fail(self, job: Job, reason: str) -> None:
        with self.lock:
            if job.status in TERMINAL_JOB_STATES:
                return
            self.set_status(job, "failed", reason)
        self.release(job, wait=False)

    def release(self, job: Job, *, wait: bool = False) -> None:
        """Stop the job's queues and close its engines. Both a cancel and the job's builder may
        call this for one engine (see ``JobBuilder``): the engine is taken under the lock, so
        exactly one of them closes it."""
        for sub in job.sub_jobs:
            with self.lock:
                if sub.status not in TERMINAL_JOB_STATES:
                    sub.status = job.status
                queue = sub.queue
                engine, sub.engine = sub.engine, None
            if queue is not None:
                queue.shutdown(wait=wait, cancel_futures=True)
            _close_engine(engine)

    def cancel_idle(self, cutoff: float, reason: str) -> list[Job]:
        """Cancel, with ``reason``, the running jobs with no op in flight whose last use is
        before ``cutoff``; those jobs, whose engines the caller then releases. Under the lock,
        as an op entering a queue is, so a job is seen either idle or busy, never between."""
        expired = []
        with self.lock:
            for job in self._jobs.values():
                if job.status == "running" and not job.in_flight and job.last_active_at < cutoff:
                    self.cancel(job, reason)
                    expired.append(job)
        return expired

    # -- persistence ------------------------------------------------------------------------

    def persist(self, job: Job) -> None:
        """Write the job's row, unless the job was dropped from its owner's history meanwhile
        (a late state change, such as a build finishing after a cancel, must not bring the row
        back); under the lock, as the drop and its delete are."""
        with self.lock:
            if self._jobs.get(job.job_id) is not job:
                return
            self.store.put_job(
                {
                    "job_id": job.job_id,
                    "owner": job.owner,
                    "status": job.status,
                    "reason": job.reason,
                    "experiment_name": job.experiment_name,
                    "request": job.request,
                    "sub_jobs": [
                        {"sub_job_id": s.sub_job_id, "kind": s.kind} for s in job.sub_jobs
                    ],
                    "created_at": job.created_at,
                    "updated_at": job.updated_at,
                }
            )

    def restore(self) -> None:
        """Reload jobs of earlier runs; those that were alive are now ``terminated``."""
        for record in self.store.jobs():
            try:
                request = CreateJobRequest.model_validate(record["request"])
            except ValidationError:
                continue
            subs = [
                SubJob(
                    sub_job_id=entry["sub_job_id"],
                    job_id=record["job_id"],
                    kind=SHORT_JOB_TYPE[spec.job_type],
                    spec=spec,
                    status=record["status"],
                )
                for entry, spec in zip(record["sub_jobs"], request.sub_job_configs, strict=True)
            ]
            job = Job(
                job_id=record["job_id"],
                owner=record["owner"],
                request=record["request"],
                experiment_name=record["experiment_name"],
                sub_jobs=subs,
                status=record["status"],
                reason=record["reason"],
                created_at=record["created_at"],
                updated_at=record["updated_at"],
            )
            self._jobs[job.job_id] = job
            if job.status not in TERMINAL_JOB_STATES:
                self.set_status(job, "terminated", "server restarted")
                for sub in subs:
                    sub.status = "terminated"


def _close_engine(engine: AnyEngine | None) -> None:
    """Release what an engine holds outside this process (Ray actors and placements, a vLLM
    process); None: the sub-job had no engine (never built, or already released)."""
    if engine is not None:
        engine.close()


def _int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{name}: {value!r} is not a cursor this server issued") from None
