"""The Service: jobs, their engines, and the ops that run on them, independent of any transport.

Every backend ends here. The in-process transport calls it directly; the on-prem and Cortex
routers (``onprem.py``, ``cortex.py``) are thin HTTP skins over it. So job states, op semantics,
validation and error codes are the same whichever way a client connects.

Jobs and sub-jobs: a job owns typed sub-jobs (``training``, ``sampling``, ``log_prob``), with ids
``{job}:{type}:{i}``; each sub-job owns one engine. A job moves ``pending -> initializing ->
running`` and ends ``failed`` (with its reason), ``cancelled`` or ``terminated``.

Ordering and concurrency: every sub-job has a single worker thread, so the ops on one sub-job run
one at a time in arrival order; a server-wide semaphore bounds how many ops run at once across
jobs. Job and checkpoint metadata are persisted in SQLite, so a restarted server still lists them
and can start a new job from a checkpoint.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from arctic_platform.contract.job_config import (
    API_JOB_TYPE,
    SHORT_JOB_TYPE,
    CreateJobRequest,
    SubJobConfig,
)
from arctic_platform.contract.ops import INLINE_OPERATIONS, OPERATION, OPERATION_TYPES, OpName
from arctic_platform.contract.problems import FieldError
from arctic_platform.contract.states import TERMINAL_JOB_STATES, JobState
from arctic_platform.engine import cancellation
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.engine.checkpoint_layout import is_loadable
from arctic_platform.engine.checkpoint_staging import recover, remove_published
from arctic_platform.server.async_requests import ChunkGroups, RequestStore
from arctic_platform.server.errors import (
    BadRequest,
    Conflict,
    EngineFailure,
    NotFound,
    ServiceError,
    checkpoint_write_failure,
)
from arctic_platform.server.idle_reaper import IdleReaper
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.metrics import ServiceMetrics
from arctic_platform.server.op_bodies import describe
from arctic_platform.server.paths import CHECKPOINTS_DIR, PathPolicy
from arctic_platform.server.ray_placement import PLACEMENT_TIMEOUT_S
from arctic_platform.server.scheduler import FairSlots
from arctic_platform.server.signed_links import LinkSigner
from arctic_platform.server.store import MetadataStore
from arctic_platform.server.tenant_quota import TenantQuota, weight_bytes

LOG_LINES_PER_JOB = 2000
log = logging.getLogger(__name__)


@dataclass
class ServiceSettings:
    """Server-wide knobs: where state lives, which device engines use, how much runs at once."""

    data_dir: Path
    device: str = "auto"
    max_concurrent_ops: int = 2
    default_seed: int = 42
    # "local": engines in this process; "ray": engines in Ray actors (a training sub-job runs
    # data-parallel over n_gpus workers), placed on shared devices when ``colocate`` is set.
    engine_backend: Literal["local", "ray"] = "local"
    colocate: bool = False
    # Ray: how long a job whose resources other jobs hold waits for them (``serve
    # --placement-timeout``), and whether the cluster can add nodes, so a demand larger than it
    # waits rather than fails (``serve --ray-autoscaling``).
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S
    ray_autoscaling: bool = False
    # Client paths stay inside each tenant's folder, or (read-only) under these prefixes; an
    # in-process Service, owned by the one user of its process, does not confine them (and only
    # there may a job name the interpreter that runs its vLLM engine).
    allowed_paths: tuple[Path, ...] = ()
    # Prefixes where clients may also save (and load back): ``serve --allow-write-path``.
    writable_paths: tuple[Path, ...] = ()
    confine_paths: bool = True
    limits: ServerLimits = field(default_factory=ServerLimits)
    # The engine of sampling sub-jobs that do not choose one, and the interpreter that runs vLLM
    # (None: $ARCTIC_VLLM_PYTHON, else this one if it has vllm).
    sampling_engine: Literal["torch", "vllm"] = "torch"
    vllm_python: str | None = None
    # At most this many of the ``max_concurrent_ops`` slots run one tenant's ops (None: all).
    max_ops_per_tenant: int | None = None
    # On close, how long ops in flight may take before their jobs are failed and stopped.
    drain_timeout_s: float = 30.0
    # A running job with no op submitted or running for this long is cancelled, its engines
    # released (``serve --job-idle-timeout``); None: jobs live until cancelled. See
    # :meth:`Service.expire_idle_jobs` for what counts as activity.
    job_idle_timeout_s: float | None = None
    # Live jobs and loaded model bytes one tenant may hold (``serve --max-jobs-per-tenant``,
    # ``--max-model-bytes-per-tenant``); unbounded by default (an in-process Service has one user).
    quota: TenantQuota = field(default_factory=TenantQuota)


@dataclass
class SubJob:
    """One engine of a job and the queue its ops run on."""

    sub_job_id: str
    job_id: str
    kind: str
    spec: SubJobConfig
    status: JobState = "pending"
    engine: Any = None
    queue: ThreadPoolExecutor | None = None
    # What the engine loads: ``spec.model_name`` checked against the owner's space (see paths.py).
    model_path: str | None = None
    # GPU-stack settings the engine could not honour here, and what it ran instead (the
    # engine's ``setting_fallbacks``): reported with the spec's ignored settings.
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


class Service:
    """Owns jobs and engines; every public method is thread-safe."""

    def __reduce__(self):
        """Refuse to be pickled, naming the fix: the engines live in this process's memory.

        The inprocess backend's ``get_server_state()`` is this object; a framework that ships it
        to another process (a Ray task, as SkyRL's driver does) would otherwise fail deep inside
        pickle with ``cannot pickle '_thread.lock'``.
        """
        raise TypeError(
            "the inprocess backend's server state (its Service and engines) lives in this "
            "process and cannot be sent to another process (a Ray task or actor, a subprocess). "
            "To share jobs across processes use the ray backend (backend: {type: ray}, or "
            "comm_protocol: ray), whose get_server_state() travels to Ray tasks, or the http "
            "backend (backend: {type: http, launch_local_server: true}), where "
            "reconnect_config() alone attaches from any process"
        )

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.limits = settings.limits
        self.metrics = ServiceMetrics()
        self.paths = PathPolicy(
            settings.data_dir,
            settings.allowed_paths,
            writable_prefixes=settings.writable_paths,
            confine=settings.confine_paths,
        )
        self.store = MetadataStore(settings.data_dir / "metadata.sqlite3")
        self.requests = RequestStore()
        self.links = LinkSigner()  # every API's signed download links
        self.chunk_groups = ChunkGroups(limits=settings.limits)
        self._lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
        self.slots = FairSlots(settings.max_concurrent_ops, settings.max_ops_per_tenant)
        # One build thread per job: a model load that hangs delays only its own job.
        self._builders: set[threading.Thread] = set()
        self._closed = False
        self._closing: threading.Event | None = None
        self._restore()
        self._adopt_legacy_checkpoints()
        self._recover_checkpoint_folders()
        # Frees abandoned chunk groups' bytes even when no chunk arrives to trigger it.
        self.chunk_reaper = IdleReaper(
            "chunk group expiry", self.chunk_groups.stale_s, self.chunk_groups.expire_stale
        )
        self.chunk_reaper.start()
        self.idle_reaper: IdleReaper | None = None
        if settings.job_idle_timeout_s is not None:
            self.idle_reaper = IdleReaper(
                "job idle timeout", settings.job_idle_timeout_s, self.expire_idle_jobs
            )
            self.idle_reaper.start()

    # -- jobs -------------------------------------------------------------------------------

    def create_job(self, request: Any, *, owner: str | None = None) -> dict:
        """Validate a create-job body, register the job and start building its engines."""
        try:
            parsed = CreateJobRequest.model_validate(request)
        except ValidationError as exc:
            raise BadRequest(f"create job: {describe(exc)}") from None
        model_paths = []
        for i, spec in enumerate(parsed.sub_job_configs):
            if spec.source_checkpoint_info is not None:
                self._source_checkpoint(spec, owner, field=f"sub_job_configs.{i}")
            self._settle_sampling_engine(spec, field=f"sub_job_configs.{i}")
            self._settle_checkpoint_dir(spec, owner, field=f"sub_job_configs.{i}")
            model_paths.append(
                self.paths.model_name(
                    owner, spec.model_name, field=f"sub_job_configs.{i}.model_name"
                )
            )
            self._check_sampling_engine(spec, model_paths[-1], field=f"sub_job_configs.{i}")
        job_id = uuid.uuid4().hex[:12]
        counts: collections.Counter = collections.Counter()
        sub_jobs = []
        for spec, model_path in zip(parsed.sub_job_configs, model_paths, strict=True):
            sub_id = f"{job_id}:{spec.kind}:{counts[spec.kind]}"
            counts[spec.kind] += 1
            sub_jobs.append(
                SubJob(
                    sub_job_id=sub_id,
                    job_id=job_id,
                    kind=spec.kind,
                    spec=spec,
                    model_path=model_path,
                )
            )
        job = Job(
            job_id=job_id,
            owner=owner,
            request=parsed.model_dump(mode="json", by_alias=True, exclude_none=True),
            experiment_name=parsed.experiment_name,
            sub_jobs=sub_jobs,
            model_bytes=sum(weight_bytes(p) for p in model_paths),
        )
        with self._lock:
            if self._closed:
                raise Conflict("the server is shutting down")
            self._check_quota(job)
            self._jobs[job_id] = job
        self._log(job, f"created with {len(sub_jobs)} sub-job(s)")
        self._persist(job)
        builder = threading.Thread(
            target=self._build, args=(job,), name=f"job-init-{job_id}", daemon=True
        )
        with self._lock:
            self._builders.add(builder)
        builder.start()
        return job.info()

    def _check_quota(self, job: Job) -> None:
        """Refuse ``job`` if its owner would hold more live jobs or model bytes than the quota
        allows, counting ``job`` (under the lock, so concurrent creates count each other)."""
        live = [
            j
            for j in self._jobs.values()
            if j.owner == job.owner and j.status not in TERMINAL_JOB_STATES and j is not job
        ]
        self.settings.quota.check(
            jobs=len(live) + 1, model_bytes=sum(j.model_bytes for j in live) + job.model_bytes
        )

    def _fetch_model(self, job: Job, sub: SubJob) -> None:
        """Before ``sub``'s engine is built: download a hub model (unlocked, with timeouts, see
        ``engine/model_files.py``) and count the weights a built-in or hub model turned out to
        have against the owner's quota. Ray workers fetch models on their own nodes."""
        from arctic_platform.engine.builtin import is_builtin
        from arctic_platform.engine.model_files import fetch_model

        if self.settings.engine_backend != "local" or sub.model_path is None:
            return
        if Path(sub.model_path).is_dir():
            return  # a local folder: measured when the job was created
        if is_builtin(sub.model_path):
            if self.settings.quota.max_model_bytes_per_tenant is None:
                return
            from arctic_platform.engine.models import local_model_path

            folder = local_model_path(sub.model_path)
        else:
            folder = sub.model_path = fetch_model(sub.model_path)
        with self._lock:
            job.model_bytes += weight_bytes(folder)
            self._check_quota(job)

    def _settle_checkpoint_dir(self, spec: SubJobConfig, owner: str | None, *, field: str) -> None:
        """Resolve a training sub-job's own checkpoint root where its owner may write (a 400
        naming the field otherwise), so the job records, and its engine uses, the checked path."""
        settings = spec.training_config
        if settings is None or settings.checkpoint_dir is None:
            return
        where = f"{field}.training_config.checkpoint_dir"
        settings.checkpoint_dir = str(
            self.paths.writable(owner, settings.checkpoint_dir, field=where)
        )

    def _settle_sampling_engine(self, spec: SubJobConfig, *, field: str) -> None:
        """Record the server's default engine in a sampling sub-job that chose none, and refuse
        a vLLM interpreter named by a job where only the operator may name one."""
        settings = spec.inference_config
        if settings is None:
            return
        if spec.kind == "sampling" and settings.engine is None:
            settings.engine = self.settings.sampling_engine
        if "python" in settings.vllm and self.settings.confine_paths:
            raise BadRequest(
                f"{field}.inference_config.vllm_config.python: this server runs vLLM with the "
                "interpreter its operator chose (serve --vllm-python); a job cannot name one"
            )

    def _check_sampling_engine(self, spec: SubJobConfig, model_path: str, *, field: str) -> None:
        """Refuse (400) a sampling sub-job whose engine would fail at start for want of
        resources here (vLLM on CPU whose memory budget cannot fit), before any process starts.
        On Ray the replica's engine checks where it runs, also before its vLLM process starts."""
        settings = spec.inference_config
        if spec.kind != "sampling" or settings.engine != "vllm":
            return
        if self.settings.engine_backend == "ray":
            return
        from arctic_platform.engine.errors import EngineInputError
        from arctic_platform.engine.sampling_backends import check_before_start
        from arctic_platform.server.job_config import sampling_engine_config

        config = sampling_engine_config(
            spec,
            device=self.settings.device,
            model_name=model_path,
            vllm_python=self.settings.vllm_python,
        )
        try:
            check_before_start(config)
        except EngineInputError as exc:
            where = f"{field}.inference_config.vllm_config"
            raise BadRequest(f"{where} ({exc.field}): {exc.message}", field=where) from None

    def get_job(self, job_id: str, *, owner: str | None = None) -> dict:
        return self.paths.redact_all(owner, self._job(job_id, owner).info())

    def job_request(self, job_id: str, *, owner: str | None = None) -> dict:
        """The create-job request the job was made from (its configuration)."""
        return self.paths.redact_all(owner, self._job(job_id, owner).request)

    def list_jobs(self, *, owner: str | None = None, status: str | None = None) -> list[dict]:
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.owner == owner]
        infos = [j.info() for j in jobs if status is None or j.status == status.lower()]
        return self.paths.redact_all(owner, infos)

    def wait_until_running(self, job_id: str, *, owner: str | None = None, timeout: float) -> dict:
        """Block until the job runs; raise if it ends or ``timeout`` passes first."""
        job = self._job(job_id, owner)
        deadline = time.monotonic() + timeout
        while job.status not in ("running", *TERMINAL_JOB_STATES):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout:.0f}s")
            time.sleep(0.02)
        if job.status != "running":
            raise Conflict(f"job {job_id} is {job.status}: {job.reason}", code=f"job_{job.status}")
        return job.info()

    def cancel_job(self, job_id: str, *, owner: str | None = None) -> dict:
        """Cancel a job: queued ops are dropped, engines released. Idempotent once cancelled."""
        job = self._job(job_id, owner)
        with self._lock:
            if job.status == "cancelled":
                return job.info()
            if job.status in ("failed", "terminated"):
                raise Conflict(
                    f"job {job_id} already ended ({job.status}); it cannot be cancelled",
                    code="failed_precondition",
                )
            self._cancel(job, "cancelled by the client")
        self._release(job)
        return job.info()

    def _cancel(self, job: Job, reason: str) -> None:
        """Mark ``job`` cancelled and stop its ops (the caller holds the lock, then releases
        the engines)."""
        job.cancelled.set()
        job.stop.cancel(f"job {job.job_id} was cancelled")
        self._set_status(job, "cancelled", reason)

    def expire_idle_jobs(self, cutoff: float) -> list[str]:
        """Cancel the running jobs idle since before ``cutoff`` (``time.time()``), exactly as
        :meth:`cancel_job` does; their ids. What the idle reaper calls.

        Idle means no op queued or running, and none submitted or finished since ``cutoff``
        (nor a poll of one by its owner: :meth:`note_activity`). Reads of a job's status, list,
        logs or checkpoints do not count, whoever makes them: an operator looking at a job
        does not keep it alive. Clients send no heartbeat of their own for jobs (a Tinker
        session's heartbeat keeps the session, not its jobs).
        """
        timeout = self.settings.job_idle_timeout_s
        reason = (
            f"expired after {timeout:g} s idle: no op was submitted or running "
            f"(serve --job-idle-timeout {timeout:g})"
        )
        expired = []
        with self._lock:
            for job in self._jobs.values():
                if job.status == "running" and not job.in_flight and job.last_active_at < cutoff:
                    self._cancel(job, reason)
                    expired.append(job)
        for job in expired:
            log.info("job %s %s", job.job_id, reason)
            self._release(job)
        return [job.job_id for job in expired]

    def note_activity(self, job_id: str, *, owner: str | None) -> None:
        """The owner used the job without submitting an op (polled one, uploaded a chunk of
        one's body): restart its idle clock. Raises ``NotFound`` as :meth:`get_job` does."""
        job = self._job(job_id, owner)
        with self._lock:
            job.last_active_at = time.time()

    def capacity(self, *, owner: str | None = None, every_tenant: bool = False) -> dict:
        """The Cortex ``capacity`` answer: the server's size, and the sub-jobs and running ops
        of ``owner`` (of every tenant for the operator's scrape credential, as ``/metrics``):
        another tenant's load is not the caller's business."""
        with self._lock:
            active = sum(
                len(j.sub_jobs)
                for j in self._jobs.values()
                if j.status not in TERMINAL_JOB_STATES and (every_tenant or j.owner == owner)
            )
        return {
            "has_reservation": False,
            "max_total_gpus": 0,
            "in_use_gpus": 0,
            "available_gpus": 0,
            "device": self.settings.device,
            "active_sub_jobs": active,
            "max_concurrent_ops": self.settings.max_concurrent_ops,
            "running_ops": self.running_ops(owner, every_tenant=every_tenant),
        }

    def running_ops(self, owner: str | None, *, every_tenant: bool = False) -> int:
        """How many of ``owner``'s ops (every tenant's) are executing on an engine right now
        (not queued ones)."""
        return self.slots.running() if every_tenant else self.slots.running_of(owner)

    def tail_logs(
        self, job_id: str, *, owner: str | None = None, cursor: Any = None, max_lines: int = 200
    ) -> dict:
        """Lines logged for a job since ``cursor`` (an opaque position this method returned)."""
        job = self._job(job_id, owner)
        with self._lock:
            start = job.log_offset if cursor in (None, "") else _int(cursor, "cursor")
            start = max(start, job.log_offset)
            lines = list(job.logs)[start - job.log_offset : start - job.log_offset + max_lines]
            end = start + len(lines)
            return {
                "entries": lines,
                "next_cursor": str(end),
                "eof": job.status in TERMINAL_JOB_STATES and end >= job.log_offset + len(job.logs),
            }

    # -- ops --------------------------------------------------------------------------------

    def dispatch(
        self, target: str, op: str, body: Any, *, owner: str | None
    ) -> tuple[SubJob | None, str, Any]:
        """Where ``op`` runs: ``(sub_job, op, body)``, with ``operation`` envelopes unwrapped.

        ``target`` is a sub-job id, or a job id (the op's natural sub-job type is then used).
        Inline operations (``cancel-request``, ``tail-logs``) come back with ``sub_job=None``.
        """
        from arctic_platform.contract.bodies import OperationBody
        from arctic_platform.server.op_bodies import parse
        from arctic_platform.server.ops import op_kind

        if op == OPERATION:
            envelope = parse(OperationBody, body, what="operation")
            op, body = envelope.operation_type, envelope.payload
            if op not in OPERATION_TYPES:
                raise BadRequest(
                    f"operation: unknown operation_type {op!r}; known: {sorted(OPERATION_TYPES)}"
                )
            if op in INLINE_OPERATIONS:
                self._job(target, owner)
                return None, op, body
            if envelope.sub_job_type is not None and envelope.sub_job_type not in SHORT_JOB_TYPE:
                raise BadRequest(f"operation: unknown sub_job_type {envelope.sub_job_type!r}")
            if envelope.sub_job_id is not None:
                sub = self.resolve(str(envelope.sub_job_id), owner=owner)
                if envelope.sub_job_type and SHORT_JOB_TYPE[envelope.sub_job_type] != sub.kind:
                    raise BadRequest(
                        f"operation: sub_job_id {envelope.sub_job_id} is not a "
                        f"{envelope.sub_job_type} sub-job"
                    )
                return sub, op, body
            if envelope.sub_job_type is not None:
                return (
                    self.resolve(target, owner=owner, kind=SHORT_JOB_TYPE[envelope.sub_job_type]),
                    op,
                    body,
                )
        if ":" in target:
            return self.resolve(target, owner=owner), op, body
        return self.resolve(target, owner=owner, kind=op_kind(op, body)), op, body

    def execute(self, target: str, op: str, body: Any, *, owner: str | None = None) -> Any:
        """Run ``op`` to completion (the in-process and on-prem paths)."""
        sub, op, body = self.dispatch(target, op, body, owner=owner)
        if sub is None:
            return self.inline_operation(target, op, body, owner=owner)
        return self.call(sub, op, body)

    def inline_operation(self, target: str, op: str, body: Any, *, owner: str | None) -> dict:
        """Operations answered at once, without entering a queue."""
        from arctic_platform.contract.bodies import CancelRequestBody, TailLogsBody
        from arctic_platform.server.op_bodies import parse

        job_id = target.split(":", 1)[0]
        if op == OpName.CANCEL_REQUEST:
            parsed = parse(CancelRequestBody, body, what=OpName.CANCEL_REQUEST)
            return self.requests.cancel(job_id, parsed.request_id)
        parsed = parse(TailLogsBody, body, what=OpName.TAIL_LOGS)
        return self.tail_logs(job_id, owner=owner, cursor=parsed.cursor, max_lines=parsed.max_lines)

    def owner_of(self, job_id: str) -> str | None:
        return self._job(job_id, None, check_owner=False).owner

    def require_running(self, sub: SubJob) -> None:
        self._require_running(self._job(sub.job_id, None, check_owner=False))

    def resolve(self, job_or_sub_id: str, *, owner: str | None, kind: str | None = None) -> SubJob:
        """A sub-job by id, or the one sub-job of ``kind`` in job ``job_or_sub_id``."""
        job_id = job_or_sub_id.split(":", 1)[0]
        job = self._job(job_id, owner)
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

    def submit(self, sub: SubJob, op: str, body: Any, *, stop: CancelToken | None = None) -> Future:
        """Queue ``op`` on ``sub``; the future resolves to the op's result or its error.

        The body is validated on the caller's thread first, so a bad request fails at once (400)
        without entering the queue. Engine errors on bad tensors also fail only the request.
        ``stop`` cancels this op alone (a Cortex ``cancel-request``), as ``job.stop`` cancels
        every op of the job: it ends with 409 ``op_cancelled`` at its next decode step or
        microbatch, leaving the job running and its engine as before the op.
        """
        from arctic_platform.server.ops import prepare_op

        self.require_running(sub)
        return self.submit_runner(sub, op, prepare_op(self, sub, op, body), stop=stop)

    def submit_runner(
        self,
        sub: SubJob,
        op: str,
        runner: Callable[[], Any],
        *,
        stop: CancelToken | None = None,
    ) -> Future:
        """Queue ``runner`` (already validated) on ``sub`` under the name ``op``, with the same
        guards as :meth:`submit`: queue order, the concurrency slots and failure handling. Other
        APIs (Tinker) build their own runners over the engines this way."""
        job = self._job(sub.job_id, None, check_owner=False)
        stops = (job.stop,) if stop is None else (job.stop, stop)
        return self._enqueue(job, sub, self._guarded, job, sub, op, runner, stops)

    def _enqueue(self, job: Job, sub: SubJob, fn, *args) -> Future:
        """Queue ``fn(*args)`` on ``sub`` as an op of ``job``: the job must be running, and it is
        busy (``in_flight``) until the op ends. Under the lock, so the idle expiry sees the job
        either idle or busy, never between."""
        with self._lock:
            self._require_running(job)
            if sub.queue is None:
                raise Conflict(f"sub-job {sub.sub_job_id} has no engine", code="job_not_running")
            job.last_active_at = time.time()
            future = sub.queue.submit(fn, *args)
            job.in_flight.add(future)
        future.add_done_callback(lambda f: self._op_done(job, f))
        return future

    def _op_done(self, job: Job, future: Future) -> None:
        with self._lock:
            job.in_flight.discard(future)

    def call(self, sub: SubJob, op: str, body: Any) -> Any:
        """Run ``op`` and wait for its result (the in-process and on-prem paths)."""
        return self.submit(sub, op, body).result()

    def run_on(self, sub: SubJob, fn, *args) -> Any:
        """Run ``fn`` on another sub-job's queue and wait (weight sync touches two engines).

        The target job counts it as its own op: it must be running (a Conflict otherwise,
        which leaves the calling job healthy), and the idle expiry sees it busy, then used."""
        target = self._job(sub.job_id, None, check_owner=False)
        future = self._enqueue(target, sub, fn, *args)
        try:
            return future.result()
        finally:
            target.last_active_at = time.time()

    def _guarded(
        self, job: Job, sub: SubJob, op: str, runner, stops: tuple[CancelToken, ...]
    ) -> Any:
        """Run ``runner`` as ``op`` of ``job``: bad input, a missing checkpoint, a refused
        checkpoint write and a stop fail only the request; anything else fails the job. Messages
        name paths as the owner may see them (``PathPolicy.redact``)."""
        from arctic_platform.engine.errors import (
            CheckpointNotFound,
            CheckpointWriteError,
            SamplerStateError,
        )

        redact = partial(self.paths.redact, job.owner)

        if job.cancelled.is_set():
            raise Conflict(f"job {job.job_id} was cancelled", code="job_cancelled")
        with self.slots.slot(job.owner), self.metrics.op(op):
            self._require_running(job)
            job.last_op, job.last_op_at = op, time.time()
            try:
                with cancellation.scope(*stops):
                    cancellation.check()  # cancelled while it waited for a slot
                    return runner()
            except ServiceError:
                raise
            except cancellation.OpCancelled as exc:
                raise Conflict(f"{op} stopped: {exc.reason}", code="op_cancelled") from None
            except CheckpointNotFound as exc:
                raise NotFound(redact(f"{op}: {exc}"), field=exc.field) from None
            except FieldError as exc:
                raise BadRequest(redact(f"{op}: {exc}"), field=exc.field) from None
            except CheckpointWriteError as exc:
                # A save only reads the engine's state: the job goes on as it was.
                self._log(job, f"{op} failed on {sub.sub_job_id}: {exc}")
                raise checkpoint_write_failure(op, exc.errno, redact(str(exc))) from None
            except SamplerStateError as exc:
                # A weight sync failed part-way: the job is healthy once a full sync succeeds.
                raise Conflict(f"{op}: {exc}", code="weights_incomplete") from None
            except Exception as exc:
                reason = redact(f"{op} failed on {sub.sub_job_id}: {type(exc).__name__}: {exc}")
                self._log(job, reason + "\n" + traceback.format_exc(limit=8))
                self._fail(job, reason)
                raise EngineFailure(reason) from exc
            finally:  # before the caller sees the result: the idle clock starts at the op's end
                job.last_active_at = time.time()

    # -- checkpoints ------------------------------------------------------------------------

    def record_checkpoint(self, sub: SubJob, saved: dict, checkpoint_type: str, avg_loss) -> dict:
        record = {
            "job_id": sub.job_id,
            "checkpoint_id": saved["checkpoint_id"],
            "sub_job_id": sub.sub_job_id,
            "path": saved["path"],
            "global_steps": saved["global_step"],
            "avg_loss": avg_loss,
            "checkpoint_type": checkpoint_type,
            "created_at": time.time(),
        }
        self.store.put_checkpoint(record)
        return record

    def list_checkpoints(self, job_id: str, *, owner: str | None = None) -> list[dict]:
        self._job(job_id, owner)
        return [
            {k: c[k] for k in ("checkpoint_id", "global_steps", "avg_loss", "checkpoint_type")}
            | {"created_at": c["created_at"]}
            for c in self.store.checkpoints(job_id)
            if Path(c["path"]).exists()
        ]

    def checkpoint(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> dict:
        self._job(job_id, owner)
        for record in self.store.checkpoints(job_id):
            if record["checkpoint_id"] == checkpoint_id and Path(record["path"]).exists():
                return record
        raise NotFound(f"checkpoint {checkpoint_id!r} not found in job {job_id}")

    def checkpoint_files(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> list[dict]:
        """Files of a checkpoint: ``filename`` (relative), absolute ``path``, ``size_bytes``."""
        root = Path(self.checkpoint(job_id, checkpoint_id, owner=owner)["path"])
        self.paths.readable(self.owner_of(job_id), str(root), field="checkpoint")
        return [
            {"filename": str(p.relative_to(root)), "path": str(p), "size_bytes": p.stat().st_size}
            for p in self.paths.within(root, sorted(root.rglob("*")))
            if p.is_file()
        ]

    def delete_checkpoint(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> None:
        """Unlist the checkpoint, then remove its folder (renamed out of sight first, so a crash
        part-way leaves nothing half-deleted under its name)."""
        record = self.checkpoint(job_id, checkpoint_id, owner=owner)
        path = self.paths.writable(owner, record["path"], field="checkpoint")
        self.store.delete_checkpoint(job_id, checkpoint_id)
        remove_published(path)

    def _source_checkpoint(self, spec: SubJobConfig, owner: str | None, *, field: str) -> dict:
        info = spec.source_checkpoint_info
        assert info is not None
        with self._lock:
            candidates = [
                j.job_id
                for j in self._jobs.values()
                if j.owner == owner and (info.source_job_id in (None, j.job_id))
            ]
        found = [
            c
            for job_id in candidates
            for c in self.store.checkpoints(job_id)
            if c["checkpoint_id"] == info.checkpoint_id and Path(c["path"]).exists()
        ]
        where = f"{field}.source_checkpoint_info"
        named = f"checkpoint {info.checkpoint_id!r} in " + (
            f"job {info.source_job_id}" if info.source_job_id else "your jobs"
        )
        if len(found) > 1:
            raise BadRequest(f"{where}: {named} is ambiguous; set source_job_id", field=where)
        if found:
            self.paths.readable(owner, found[0]["path"], field=where)
        if not found or not is_loadable(found[0]["path"]):
            raise NotFound(f"{where}: {named} is not found", field=where)
        return found[0]

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, drain_timeout: float | None = None) -> None:
        """Stop accepting work and let ops in flight finish, for at most ``drain_timeout`` seconds
        (default ``settings.drain_timeout_s``); then the jobs still busy are failed with that
        reason and their ops stopped at their next decode step or microbatch. Engines are
        released either way."""
        with self._lock:
            closing, first = self._closing, self._closing is None
            if first:
                closing = self._closing = threading.Event()
        if not first:
            closing.wait()  # a close under way (the signal's drain, then the app's shutdown)
            return
        try:
            self._drain(drain_timeout)
        finally:
            closing.set()

    def _drain(self, drain_timeout: float | None) -> None:
        self.chunk_reaper.stop()
        if self.idle_reaper is not None:
            self.idle_reaper.stop()
        timeout = self.settings.drain_timeout_s if drain_timeout is None else drain_timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            builders = list(self._builders)
        for job in jobs:
            if job.status in ("pending", "initializing"):
                job.cancelled.set()  # a build under way stops before its next engine
                job.stop.cancel("the server is shutting down")  # and waits for no resources
        for builder in builders:
            builder.join(max(0.0, deadline - time.monotonic()))
        for job in jobs:
            for sub in job.sub_jobs:
                if sub.queue is not None:
                    sub.queue.shutdown(wait=False)  # queued ops still run, new ones are refused
        with self._lock:
            pending = [f for job in jobs for f in job.in_flight]
        wait_futures(pending, timeout=max(0.0, deadline - time.monotonic()))
        for job in jobs:
            with self._lock:
                busy = bool(job.in_flight)
            if busy:
                reason = f"server shut down with ops in flight after --drain-timeout {timeout:g}s"
                job.stop.cancel(reason)  # its ops stop at their next step or microbatch
                self._fail(job, reason)
            elif job.status not in TERMINAL_JOB_STATES:
                self._set_status(job, "terminated", "server shut down")
            self._release(job)
        self.store.close()

    def metrics_exposition(self, *, owner: str | None, every_tenant: bool = False) -> bytes:
        """``GET /metrics``: op series of the whole server, job gauges of ``owner``'s jobs (of
        every tenant's for the operator's scrape credential)."""
        with self._lock:
            jobs = [
                (j.job_id, j.status, len(j.in_flight))
                for j in self._jobs.values()
                if every_tenant or j.owner == owner
            ]
        return self.metrics.exposition(jobs)

    def busy(self) -> int:
        """Ops submitted and not yet finished, across jobs."""
        with self._lock:
            return sum(len(j.in_flight) for j in self._jobs.values())

    def _build(self, job: Job) -> None:
        try:
            self._build_engines(job)
        finally:
            with self._lock:
                self._builders.discard(threading.current_thread())

    def _build_engines(self, job: Job) -> None:
        from arctic_platform.server.engines import build_engine

        if job.cancelled.is_set():
            return
        self._set_status(job, "initializing", None)
        try:
            for sub in job.sub_jobs:
                if job.cancelled.is_set():
                    return
                sub.status = "initializing"
                source = None
                if sub.spec.source_checkpoint_info is not None:
                    source = self._source_checkpoint(sub.spec, job.owner, field="sub_job_configs")
                self._fetch_model(job, sub)
                # A cancel stops a build that waits (for Ray resources) and releases what it holds.
                with cancellation.scope(job.stop):
                    engine = build_engine(self, sub, source)
                sub.queue = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=sub.sub_job_id.replace(":", "-")
                )
                sub.engine = engine
                sub.fallbacks = dict(getattr(engine, "setting_fallbacks", {}))
                for setting, fallback in sub.fallbacks.items():
                    self._log(job, f"{sub.sub_job_id}: {setting}: {fallback}")
                sub.status = "running"
                # Checked only once the engine is stored: a cancel that came earlier released
                # nothing of this engine, so it is released here; one that comes later finds it
                # stored. Checked before the store, a cancel landing in between would leak it
                # (on Ray: its actors and the job's placement group, until the server restarts).
                if job.cancelled.is_set():
                    self._release(job)
                    return
                self._log(job, f"{sub.sub_job_id}: engine ready ({sub.spec.model_name})")
        except cancellation.OpCancelled as exc:
            self._log(job, f"initialization stopped: {exc}")
            return
        except Exception as exc:
            reason = f"initialization failed: {type(exc).__name__}: {exc}"
            self._log(job, reason + "\n" + traceback.format_exc(limit=8))
            self._fail(job, reason)
            return
        with self._lock:
            if job.status == "initializing":
                job.last_active_at = time.time()
                self._set_status(job, "running", None)

    def _fail(self, job: Job, reason: str) -> None:
        with self._lock:
            if job.status in TERMINAL_JOB_STATES:
                return
            self._set_status(job, "failed", reason)
        self._release(job, wait=False)

    def _release(self, job: Job, *, wait: bool = False) -> None:
        """Stop the job's queues and close its engines. Both a cancel and the job's builder may
        call this for one engine (see :meth:`_build_engines`): the engine is taken under the
        lock, so exactly one of them closes it."""
        for sub in job.sub_jobs:
            with self._lock:
                if sub.status not in TERMINAL_JOB_STATES:
                    sub.status = job.status
                queue = sub.queue
                engine, sub.engine = sub.engine, None
            if queue is not None:
                queue.shutdown(wait=wait, cancel_futures=True)
            _close_engine(engine)

    def _set_status(self, job: Job, status: JobState, reason: str | None) -> None:
        if reason is not None:
            reason = self.paths.redact(job.owner, reason)
        with self._lock:
            job.status = status
            job.reason = reason
            job.updated_at = time.time()
        self._log(job, f"status {status}" + (f": {reason}" if reason else ""))
        self._persist(job)

    def _persist(self, job: Job) -> None:
        self.store.put_job(
            {
                "job_id": job.job_id,
                "owner": job.owner,
                "status": job.status,
                "reason": job.reason,
                "experiment_name": job.experiment_name,
                "request": job.request,
                "sub_jobs": [{"sub_job_id": s.sub_job_id, "kind": s.kind} for s in job.sub_jobs],
                "created_at": job.created_at,
                "updated_at": job.updated_at,
            }
        )

    def _restore(self) -> None:
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
                self._set_status(job, "terminated", "server restarted")
                for sub in subs:
                    sub.status = "terminated"

    def _adopt_legacy_checkpoints(self) -> None:
        """Move checkpoints of the layout before tenant folders (``<data-dir>/checkpoints/<sub-job
        folder>``) into their job owner's space, where that owner (and only they) can load and
        export them. A folder whose job this server does not know stays where it is, served to
        no one, and the log names it for the operator."""
        legacy = self.settings.data_dir.resolve() / CHECKPOINTS_DIR
        if not legacy.is_dir() or legacy.is_symlink():
            return
        for folder in sorted(legacy.iterdir()):
            job = self._jobs.get(folder.name.split("-", 1)[0])
            target = None if job is None else self.paths.checkpoint_root(job.owner) / folder.name
            if job is None or folder.is_symlink() or not folder.is_dir() or target.exists():
                log.warning(
                    "%s: checkpoints of the layout before tenant folders whose owner is not "
                    "known; not served to any tenant (move it into %s/<tenant>/%s/ to give it "
                    "to one)",
                    folder,
                    self.paths.root,
                    CHECKPOINTS_DIR,
                )
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            folder.rename(target)
            for record in self.store.checkpoints(job.job_id):
                old = Path(record["path"]).resolve()
                if old.is_relative_to(folder):
                    self.store.put_checkpoint(
                        record
                        | {"job_id": job.job_id, "path": str(target / old.relative_to(folder))}
                    )
            log.info("moved %s into its owner's space: %s", folder, target)

    def _recover_checkpoint_folders(self) -> None:
        """Undo what saves killed with an earlier server process left (otherwise only undone by
        a later save into the same folder): a checkpoint being replaced is back under its name,
        half-written ones are gone (``engine/checkpoint_staging.py``)."""
        folders = set(self.paths.root.glob(f"*/{CHECKPOINTS_DIR}/*"))
        for job_id in list(self._jobs):
            folders.update(Path(c["path"]).parent for c in self.store.checkpoints(job_id))
        for path in recover(folders):
            log.info("recovered %s, left by a save that did not finish", path)

    def _job(self, job_id: str, owner: str | None, *, check_owner: bool = True) -> Job:
        with self._lock:
            job = self._jobs.get(str(job_id).split(":", 1)[0])
        if job is None or (check_owner and job.owner != owner):
            raise NotFound(f"job {job_id!r} not found")
        return job

    def _require_running(self, job: Job) -> None:
        if job.status != "running":
            detail = f": {job.reason}" if job.reason else ""
            raise Conflict(f"job {job.job_id} is {job.status}{detail}", code=f"job_{job.status}")

    def note(self, job_id: str, line: str) -> None:
        """Add ``line`` to the job's log: what an engine builder reports while the job starts
        (the Ray backend says what resources it waits for)."""
        self._log(self._job(job_id, None, check_owner=False), line)

    def _log(self, job: Job, line: str) -> None:
        """Add ``line`` to the job's log, which its owner reads (paths redacted)."""
        line = self.paths.redact(job.owner, line)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        with self._lock:
            if len(job.logs) == job.logs.maxlen:
                job.log_offset += 1
            job.logs.append(f"{stamp} {line}")


def _close_engine(engine: Any) -> None:
    """Release what an engine holds outside this process (Ray actors and placements)."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{name}: {value!r} is not a cursor this server issued") from None
