"""From a create-job body to running engines: validate and settle each sub-job's spec, then
build its engines on the job's own thread.

Everything a job could be refused for here (a bad field, a path outside the owner's space, a
missing source checkpoint, a vLLM budget that cannot fit) is checked on the caller's thread,
before the job exists, so it is a 400 naming the field. Building then runs on one thread per job:
a model load that hangs delays only its own job, and a cancel or shutdown stops it between
engines (or, on Ray, while it waits for resources).
"""

from __future__ import annotations

import collections
import json
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from arctic_platform.contract.job_config import CreateJobRequest, SubJobConfig
from arctic_platform.contract.job_ids import sub_job_id
from arctic_platform.contract.problems import FieldError
from arctic_platform.engine import cancellation
from arctic_platform.server.checkpoint_catalogue import CheckpointCatalogue
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.job_registry import Job, JobRegistry, SubJob
from arctic_platform.server.op_bodies import describe, field_of
from arctic_platform.server.paths import PathPolicy
from arctic_platform.server.sub_job_queue import SubJobQueue
from arctic_platform.server.tenant_quota import weight_bytes
from arctic_platform.server.vllm_policy import check_tenant_vllm

# The most a job's configuration (its create body, as stored) may hold: it is kept in memory
# and in the store for as long as the job is listed, up to the owner's MAX_ENDED_JOBS_PER_TENANT
# ended ones, so without a bound a tenant creating jobs that fail at once, each with megabytes in
# a free-form field, grew both by gigabytes. Real configurations (DeepSpeed's included) are KB.
MAX_JOB_CONFIG_BYTES = 1 << 20

if TYPE_CHECKING:
    from arctic_platform.server.engines import EngineBuilder
    from arctic_platform.server.service import Service, ServiceSettings


class JobBuilder:
    """Lays out new jobs from their requests and builds their engines, one thread per job."""

    def __init__(
        self,
        settings: ServiceSettings,
        paths: PathPolicy,
        jobs: JobRegistry,
        checkpoints: CheckpointCatalogue,
        engine_host: Service,
        engine_builder: EngineBuilder | None = None,
    ) -> None:
        self.settings = settings
        self.paths = paths
        self.jobs = jobs
        self.checkpoints = checkpoints
        # What engines are built against (``engines.build_engine``): the Ray engines log
        # through it and read its settings, paths and owners.
        self.engine_host = engine_host
        # None: ``engines.build_engine``, looked up when a job is built (see EngineBuilder).
        self.engine_builder = engine_builder
        # Build threads under way, guarded by the registry's lock (a shutdown joins them).
        self._threads: set[threading.Thread] = set()

    def new_job(self, request: Any, *, owner: str | None) -> Job:
        """Validate a create-job body and settle each sub-job's spec (a 400 naming the field);
        the job, with a new id and its sub-jobs, not yet registered."""
        try:
            parsed = CreateJobRequest.model_validate(request)
        except ValidationError as exc:
            raise BadRequest(f"create job: {describe(exc)}", field=field_of(exc)) from None
        model_paths = []
        for i, spec in enumerate(parsed.sub_job_configs):
            if spec.source_checkpoint_info is not None:
                self.checkpoints.source(spec, owner, field=f"sub_job_configs.{i}")
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
            sub_id = sub_job_id(job_id, spec.kind, counts[spec.kind])
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
        stored = parsed.model_dump(mode="json", by_alias=True, exclude_none=True)
        ignored = [spec.ignored_settings for spec in parsed.sub_job_configs]  # kept too
        size = len(json.dumps([stored, ignored], default=str))
        if size > MAX_JOB_CONFIG_BYTES:  # kept with the job, after it ends too
            raise BadRequest(
                f"create job: the job's configuration is {size} bytes as stored; at most "
                f"{MAX_JOB_CONFIG_BYTES} are kept for a job (send data to its ops, not its "
                "configuration)"
            )
        return Job(
            job_id=job_id,
            owner=owner,
            request=stored,
            experiment_name=parsed.experiment_name,
            sub_jobs=sub_jobs,
            model_bytes=sum(weight_bytes(p) for p in model_paths),
        )

    def start(self, job: Job) -> None:
        """Build the registered ``job``'s engines on a thread of its own."""
        builder = threading.Thread(
            target=self._build, args=(job,), name=f"job-init-{job.job_id}", daemon=True
        )
        with self.jobs.lock:
            self._threads.add(builder)
        builder.start()

    def threads(self) -> list[threading.Thread]:
        """The builds under way (the caller holds the registry's lock)."""
        return list(self._threads)

    def _build(self, job: Job) -> None:
        try:
            self._build_engines(job)
        finally:
            with self.jobs.lock:
                self._threads.discard(threading.current_thread())

    def _build_engines(self, job: Job) -> None:
        from arctic_platform.server import engines

        build_engine = self.engine_builder or engines.build_engine
        if job.cancelled.is_set():
            return
        self.jobs.set_status(job, "initializing", None)
        try:
            for sub in job.sub_jobs:
                if job.cancelled.is_set():
                    return
                sub.status = "initializing"
                source = None
                if sub.spec.source_checkpoint_info is not None:
                    source = self.checkpoints.source(sub.spec, job.owner, field="sub_job_configs")
                self._fetch_model(job, sub)
                # A cancel stops a build that waits (for Ray resources) and releases what it holds.
                with cancellation.scope(job.stop):
                    engine = build_engine(self.engine_host, sub, source)
                sub.queue = SubJobQueue(
                    sub.sub_job_id.replace(":", "-"),
                    max_shared=self.engine_host.slots.per_tenant,
                )
                sub.engine = engine
                if sub.kind == "training":  # only a trainer has settings to fall back
                    sub.fallbacks = dict(engine.setting_fallbacks)
                for setting, fallback in sub.fallbacks.items():
                    self.jobs.log(job, f"{sub.sub_job_id}: {setting}: {fallback}")
                sub.status = "running"
                # Checked only once the engine is stored: a cancel that came earlier released
                # nothing of this engine, so it is released here; one that comes later finds it
                # stored. Checked before the store, a cancel landing in between would leak it
                # (on Ray: its actors and the job's placement group, until the server restarts).
                if job.cancelled.is_set():
                    self.jobs.release(job)
                    return
                self.jobs.log(job, f"{sub.sub_job_id}: engine ready ({sub.spec.model_name})")
        except cancellation.OpCancelled as exc:
            self.jobs.log(job, f"initialization stopped: {exc}")
            return
        except Exception as exc:
            reason = f"initialization failed: {type(exc).__name__}: {exc}"
            self.jobs.log(job, reason + "\n" + traceback.format_exc(limit=8))
            self.jobs.fail(job, reason)
            return
        with self.jobs.lock:
            if job.status == "initializing":
                job.last_active_at = time.time()
                self.jobs.set_status(job, "running", None)

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
        with self.jobs.lock:
            job.model_bytes += weight_bytes(folder)
            self.jobs.check_quota(job)

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
        what a tenant's job may not set of a vLLM process where tenants are confined
        (``vllm_policy.py``)."""
        settings = spec.inference_config
        if settings is None:
            return
        if spec.kind == "sampling" and settings.engine is None:
            settings.engine = self.settings.sampling_engine
        if self.settings.confine_paths:
            check_tenant_vllm(
                settings.vllm_settings,
                field=f"{field}.inference_config.vllm_config",
                starts_vllm=spec.kind == "sampling" and settings.engine == "vllm",
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
        except FieldError as exc:
            where = f"{field}.inference_config.vllm_config"
            raise BadRequest(f"{where} ({exc.field}): {exc.message}", field=where) from None
