"""The Service: jobs, their engines, and the ops that run on them, independent of any transport.

Every backend ends here. The in-process transport calls it directly; the on-prem and Cortex
routers (``onprem.py``, ``cortex.py``) are thin HTTP skins over it. So job states, op semantics,
validation and error codes are the same whichever way a client connects.

Jobs and sub-jobs: a job owns typed sub-jobs (``training``, ``sampling``, ``log_prob``), with ids
``{job}:{type}:{i}``; each sub-job owns one engine. A job moves ``pending -> initializing ->
running`` and ends ``failed`` (with its reason), ``cancelled`` or ``terminated``.

The Service is the facade the API adapters use; it composes parts with one job each and
delegates to them: the job registry and its SQLite mirror (``job_registry.py``), the job builder
(``job_builder.py``: a create-job body to running engines), the op executor (``executor.py``:
routing, per-sub-job queues, concurrency slots and the error guard), the checkpoint catalogue
(``checkpoint_catalogue.py``) and the shutdown drain (``shutdown.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from arctic_platform.contract.job_ops import JOB_OPS
from arctic_platform.contract.states import JOB_STATES, STARTING_JOB_STATES, TERMINAL_JOB_STATES
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.server.async_requests import ChunkGroups, RequestStore
from arctic_platform.server.checkpoint_catalogue import CheckpointCatalogue
from arctic_platform.server.errors import BadRequest, Conflict, result_of
from arctic_platform.server.executor import OpExecutor
from arctic_platform.server.idle_reaper import IdleReaper
from arctic_platform.server.job_builder import JobBuilder
from arctic_platform.server.job_ops import JOB_POLL_S, run_job_op
from arctic_platform.server.job_registry import JobRegistry, SubJob
from arctic_platform.server.limits import MIB, ServerLimits
from arctic_platform.server.metrics import ServiceMetrics
from arctic_platform.server.paths import PathPolicy
from arctic_platform.server.pending_work import PendingWork, payload_nbytes
from arctic_platform.server.ray_placement import PLACEMENT_TIMEOUT_S
from arctic_platform.server.scheduler import FairSlots
from arctic_platform.server.shutdown import drain
from arctic_platform.server.signed_links import LinkSigner
from arctic_platform.server.store import MetadataStore
from arctic_platform.server.tenant_quota import TenantQuota

if TYPE_CHECKING:
    from arctic_platform.server.engines import EngineBuilder

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


@dataclass(frozen=True)
class Started:
    """An op on its way (:meth:`Service.start`): the sub-job it runs on (None for an inline
    operation), its name once an ``operation`` envelope is unwrapped, and its future."""

    sub: SubJob | None
    op: str
    future: Future


class Service:
    """Owns jobs and engines through its parts (see the module doc); every public method is
    thread-safe."""

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

    def __init__(
        self, settings: ServiceSettings, *, engine_builder: EngineBuilder | None = None
    ) -> None:
        """``engine_builder``: who builds each sub-job's engine (default: the engines of
        ``settings.engine_backend``, ``engines.build_engine``); tests pass a builder of fakes."""
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
        self.requests = RequestStore(
            max_finished_bytes=settings.limits.max_retained_results_mb * MIB
        )
        self.links = LinkSigner()  # every API's signed download links
        self.chunk_groups = ChunkGroups(limits=settings.limits)
        self.pending = PendingWork()  # each tenant's bytes in unfinished ops
        self.slots = FairSlots(settings.max_concurrent_ops, settings.max_ops_per_tenant)
        self.jobs = JobRegistry(self.store, self.paths, settings.quota)
        self.checkpoints = CheckpointCatalogue(self.store, self.paths, self.jobs, settings.data_dir)
        self.builder = JobBuilder(
            settings, self.paths, self.jobs, self.checkpoints, self, engine_builder
        )
        self.executor = OpExecutor(self.jobs, self.slots, self.metrics, self.paths, self.requests)
        # Made by the first close and set once its drain is done; a later close waits on it.
        self._closing: threading.Event | None = None
        self.jobs.restore()
        self.checkpoints.adopt_legacy()
        self.checkpoints.recover_folders()
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
        job = self.builder.new_job(request, owner=owner)
        self.jobs.add(job)
        self.builder.start(job)
        return job.info()

    def get_job(self, job_id: str, *, owner: str | None = None, wait_s: float = 0.0) -> dict:
        """The job's info; while it is starting, held up to ``wait_s`` until it runs or ends
        (a long poll on this thread: the HTTP routes wait on the event loop instead,
        ``server/job_ops.settled_info``)."""
        job = self.jobs.get(job_id, owner)
        deadline = time.monotonic() + wait_s
        while job.status in STARTING_JOB_STATES and time.monotonic() < deadline:
            time.sleep(JOB_POLL_S)
        return self.paths.redact_all(owner, job.info())

    def job_status(self, job_id: str, *, owner: str | None = None) -> str:
        """The job's status alone: what a waiting poll checks, without building its info."""
        return self.jobs.get(job_id, owner).status

    def job_request(self, job_id: str, *, owner: str | None = None) -> dict:
        """The create-job request the job was made from (its configuration)."""
        return self.paths.redact_all(owner, self.jobs.get(job_id, owner).request)

    def list_jobs(self, *, owner: str | None = None, status: str | None = None) -> list[dict]:
        """The owner's jobs, those in ``status`` only when given (an unknown one is a 400 on
        every surface that filters: the jobs API, Cortex)."""
        if status is not None and status.lower() not in JOB_STATES:
            raise BadRequest(
                f"status: unknown job state {status!r}; known: {', '.join(JOB_STATES)}",
                field="status",
            )
        jobs = [j for j in self.jobs.all() if j.owner == owner]
        infos = [j.info() for j in jobs if status is None or j.status == status.lower()]
        return self.paths.redact_all(owner, infos)

    def wait_until_running(self, job_id: str, *, owner: str | None = None, timeout: float) -> dict:
        """Block until the job runs; raise if it ends or ``timeout`` passes first (the HTTP
        routes wait on the event loop instead, ``server/job_ops.running_info``)."""
        self.get_job(job_id, owner=owner, wait_s=timeout)
        return self.running_job_info(job_id, owner=owner, waited=timeout)

    def running_job_info(self, job_id: str, *, owner: str | None = None, waited: float) -> dict:
        """The info of a job that runs; raise if it is still starting after the ``waited``
        seconds a caller waited, or ended."""
        job = self.jobs.get(job_id, owner)
        if job.status in STARTING_JOB_STATES:
            raise TimeoutError(f"job {job_id} is still {job.status} after {waited:.0f}s")
        if job.status != "running":
            raise Conflict(f"job {job_id} is {job.status}: {job.reason}", code=f"job_{job.status}")
        return job.info()

    def cancel_job(self, job_id: str, *, owner: str | None = None) -> dict:
        """Cancel a job: queued ops are dropped, engines released. Idempotent once cancelled."""
        job = self.jobs.get(job_id, owner)
        with self.jobs.lock:
            if job.status == "cancelled":
                return job.info()
            if job.status in ("failed", "terminated"):
                raise Conflict(
                    f"job {job_id} already ended ({job.status}); it cannot be cancelled",
                    code="failed_precondition",
                )
            self.jobs.cancel(job, "cancelled by the client")
        self.jobs.release(job)
        return job.info()

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
        expired = self.jobs.cancel_idle(cutoff, reason)
        for job in expired:
            log.info("job %s %s", job.job_id, reason)
            self.jobs.release(job)
        return [job.job_id for job in expired]

    def note_activity(self, job_id: str, *, owner: str | None) -> None:
        """The owner used the job without submitting an op (polled one, uploaded a chunk of
        one's body): restart its idle clock. Raises ``NotFound`` as :meth:`get_job` does."""
        job = self.jobs.get(job_id, owner)
        with self.jobs.lock:
            job.last_active_at = time.time()

    def note(self, job_id: str, line: str) -> None:
        """Add ``line`` to the job's log: what an engine builder reports while the job starts
        (the Ray backend says what resources it waits for)."""
        self.jobs.log(self.jobs.get(job_id, None, check_owner=False), line)

    def tail_logs(
        self, job_id: str, *, owner: str | None = None, cursor: Any = None, max_lines: int = 200
    ) -> dict:
        """Lines logged for a job since ``cursor`` (an opaque position this method returned)."""
        return self.jobs.tail_logs(job_id, owner=owner, cursor=cursor, max_lines=max_lines)

    def owner_of(self, job_id: str) -> str | None:
        return self.jobs.get(job_id, None, check_owner=False).owner

    def require_running(self, sub: SubJob) -> None:
        self.jobs.require_running(self.jobs.get(sub.job_id, None, check_owner=False))

    def resolve(self, job_or_sub_id: str, *, owner: str | None, kind: str | None = None) -> SubJob:
        """A sub-job by id, or the one sub-job of ``kind`` in job ``job_or_sub_id``."""
        return self.jobs.resolve(job_or_sub_id, owner=owner, kind=kind)

    # -- capacity and metrics ---------------------------------------------------------------

    def capacity(self, *, owner: str | None = None, every_tenant: bool = False) -> dict:
        """The Cortex ``capacity`` answer: the server's size, and the sub-jobs and running ops
        of ``owner`` (of every tenant for the operator's scrape credential, as ``/metrics``):
        another tenant's load is not the caller's business."""
        with self.jobs.lock:
            active = sum(
                len(j.sub_jobs)
                for j in self.jobs.all()
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

    def metrics_exposition(self, *, owner: str | None, every_tenant: bool = False) -> bytes:
        """``GET /metrics``: op series of the whole server, job gauges of ``owner``'s jobs (of
        every tenant's for the operator's scrape credential)."""
        with self.jobs.lock:
            jobs = [
                (j.job_id, j.status, len(j.in_flight))
                for j in self.jobs.all()
                if every_tenant or j.owner == owner
            ]
        return self.metrics.exposition(jobs)

    def busy(self) -> int:
        """Ops submitted and not yet finished, across jobs."""
        with self.jobs.lock:
            return sum(len(j.in_flight) for j in self.jobs.all())

    # -- ops --------------------------------------------------------------------------------

    def dispatch(
        self, target: str, op: str, body: Any, *, owner: str | None
    ) -> tuple[SubJob | None, str, Any]:
        """Where ``op`` runs: ``(sub_job, op, body)``, with ``operation`` envelopes unwrapped;
        ``sub_job`` is None for inline operations (see :meth:`OpExecutor.dispatch`)."""
        return self.executor.dispatch(target, op, body, owner=owner)

    def start(self, target: str, op: str, body: Any, *, owner: str | None) -> Started:
        """Route ``op`` and set it going: queued on its sub-job, or, for an inline operation,
        answered now (its future already done). What every adapter that waits for the answer
        runs (:meth:`execute`, the in-process transport's async path, the on-prem API); the
        Cortex API records an async request first, so it dispatches and submits itself."""
        sub, op, body = self.dispatch(target, op, body, owner=owner)
        if sub is None:
            answered: Future = Future()
            answered.set_result(self.inline_operation(target, op, body, owner=owner))
            return Started(None, op, answered)
        return Started(sub, op, self.submit(sub, op, body))

    def execute(self, target: str, op: str, body: Any, *, owner: str | None = None) -> Any:
        """Run ``op`` to completion (the in-process and Ray paths); job ops included."""
        if op in JOB_OPS:
            return run_job_op(self, op, target, body, owner=owner)
        return result_of(self.start(target, op, body, owner=owner).future)

    def inline_operation(self, target: str, op: str, body: Any, *, owner: str | None) -> dict:
        """Operations answered at once, without entering a queue."""
        return self.executor.inline_operation(target, op, body, owner=owner)

    def submit(self, sub: SubJob, op: str, body: Any, *, stop: CancelToken | None = None) -> Future:
        """Queue ``op`` on ``sub``; the future resolves to the op's result or its error.

        The body is validated on the caller's thread first, so a bad request fails at once (400)
        without entering the queue. Engine errors on bad tensors also fail only the request.
        ``stop`` cancels this op alone (a Cortex ``cancel-request``), as ``job.stop`` cancels
        every op of the job: it ends with 409 ``op_cancelled`` at its next decode step or
        microbatch, leaving the job running and its engine as before the op. The op's bytes
        count among its owner's unfinished ops until it ends (``pending_work.py``): beyond
        ``--max-pending-mb-per-tenant`` it is refused before it is validated or queued.
        """
        from arctic_platform.server.ops import prepare_op

        self.require_running(sub)
        owner = self.jobs.get(sub.job_id, None, check_owner=False).owner
        release = self.pending.take(owner, payload_nbytes(body), self.limits)
        try:
            future = self.executor.submit_runner(
                sub, op, prepare_op(self, sub, op, body), stop=stop
            )
        except BaseException:
            release()
            raise
        return self.pending.until(future, release)

    def call(self, sub: SubJob, op: str, body: Any) -> Any:
        """Run ``op`` and wait for its result (the in-process and on-prem paths)."""
        return result_of(self.submit(sub, op, body))

    def run_on(self, sub: SubJob, fn, *args) -> Any:
        """Run ``fn`` on another sub-job's queue and wait (weight sync touches two engines)."""
        return self.executor.run_on(sub, fn, *args)

    # -- checkpoints ------------------------------------------------------------------------

    def record_checkpoint(self, sub: SubJob, saved: dict, checkpoint_type: str, avg_loss) -> dict:
        return self.checkpoints.record(sub, saved, checkpoint_type, avg_loss)

    def list_checkpoints(self, job_id: str, *, owner: str | None = None) -> list[dict]:
        return self.checkpoints.summaries(job_id, owner=owner)

    def checkpoint(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> dict:
        return self.checkpoints.get(job_id, checkpoint_id, owner=owner)

    def checkpoint_files(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> list[dict]:
        """Files of a checkpoint: ``filename`` (relative), absolute ``path``, ``size_bytes``."""
        return self.checkpoints.files(job_id, checkpoint_id, owner=owner)

    def checkpoint_file(
        self, job_id: str, checkpoint_id: str, filename: str, *, owner: str | None
    ) -> Path:
        """One file of a checkpoint by its relative name; 404 if the checkpoint lists none."""
        return self.checkpoints.file(job_id, checkpoint_id, filename, owner=owner)

    def delete_checkpoint(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> None:
        """Unlist the checkpoint, then remove its folder."""
        self.checkpoints.delete(job_id, checkpoint_id, owner=owner)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, drain_timeout: float | None = None) -> None:
        """Stop accepting work and let ops in flight finish, for at most ``drain_timeout`` seconds
        (default ``settings.drain_timeout_s``); then the jobs still busy are failed with that
        reason and their ops stopped at their next decode step or microbatch. Engines are
        released either way (``shutdown.drain``)."""
        with self.jobs.lock:
            closing, first = self._closing, self._closing is None
            if first:
                closing = self._closing = threading.Event()
        if not first:
            closing.wait()  # a close under way (the signal's drain, then the app's shutdown)
            return
        try:
            self.chunk_reaper.stop()
            if self.idle_reaper is not None:
                self.idle_reaper.stop()
            timeout = self.settings.drain_timeout_s if drain_timeout is None else drain_timeout
            drain(self.jobs, self.builder, timeout)
            self.store.close()
        finally:
            closing.set()
