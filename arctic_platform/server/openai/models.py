"""What a ``model`` names, and the caller's job that serves it.

``model`` is one of (Tinker's spellings included):

* a base model the server serves: ``builtin:<size>``, a hub id, or a folder the caller may read;
* ``job:<job_id>/<checkpoint_id>`` — a checkpoint of one of the caller's jobs, or
  ``job:<job_id>`` for its latest one (both need full weights: a LoRA job saves them with
  ``export_hf=true``);
* ``tinker://<model_id>/sampler_weights/<name>`` — a Tinker ``save_weights_for_sampler`` path;
* ``<base model>;<checkpoint>`` — Tinker's form; the checkpoint holds full weights, so it is used
  alone.

Another tenant's job or run is a 404, as on every other API. The weights are served by the
owner's model jobs that Tinker samplers use too (:class:`~arctic_platform.server.tinker.
model_samplers.ModelSamplingJobs`): started on first use, at most a few per owner, the least
recently used idle one released first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi.concurrency import run_in_threadpool

from arctic_platform.contract.job_ids import parent_of
from arctic_platform.engine.builtin import BUILTIN_MODELS, BUILTIN_PREFIX
from arctic_platform.server.engines import weights_dir
from arctic_platform.server.errors import BadRequest, NotFound
from arctic_platform.server.job_ops import running_info
from arctic_platform.server.job_registry import SubJob
from arctic_platform.server.service import Service
from arctic_platform.server.tinker.checkpoints import SCHEME as TINKER_SCHEME
from arctic_platform.server.tinker.checkpoints import TinkerPath
from arctic_platform.server.tinker.operations import STARTUP_TIMEOUT_S, TinkerOps

JOB_SCHEME = "job:"


@dataclass(frozen=True)
class ModelRef:
    """``name`` as the caller wrote it (answers echo it); ``weights`` what the model job loads."""

    name: str
    weights: str


def resolve(service: Service, tinker: TinkerOps, owner: str | None, name: str) -> ModelRef:
    """The weights ``name`` stands for (see module doc); 404 for what the caller cannot see."""
    spec = name
    if ";" in name:
        _, _, spec = name.partition(";")
        if not spec:
            raise BadRequest(f"model: {name!r} names no checkpoint after ';'", param="model")
    if spec.startswith(TINKER_SCHEME):
        path = TinkerPath.parse(spec, field="model")
        return ModelRef(name, str(tinker.checkpoints.sampler_model_dir(path, owner)))
    if spec.startswith(JOB_SCHEME):
        job_id, _, checkpoint_id = spec[len(JOB_SCHEME) :].partition("/")
        if not checkpoint_id:
            saved = service.list_checkpoints(job_id, owner=owner)
            if not saved:
                raise NotFound(f"model: job {job_id} has no checkpoint yet", param="model")
            checkpoint_id = saved[-1]["checkpoint_id"]
        record = service.checkpoint(job_id, checkpoint_id, owner=owner)
        return ModelRef(name, weights_dir(record, field="model"))
    return ModelRef(name, service.paths.model_name(owner, spec, field="model"))


def listed(service: Service, tinker: TinkerOps, owner: str | None) -> list[str]:
    """The model names the caller can use without knowing a path: the built-in models, the
    checkpoints of its jobs and its Tinker sampler checkpoints."""
    names = [BUILTIN_PREFIX + size for size in BUILTIN_MODELS]
    for job in service.list_jobs(owner=owner):
        for saved in service.list_checkpoints(job["job_id"], owner=owner):
            names.append(f"{JOB_SCHEME}{job['job_id']}/{saved['checkpoint_id']}")
    for run in tinker.checkpoints.runs(owner):
        for saved in tinker.checkpoints.list(run["model_id"], owner):
            if saved["checkpoint_type"] == "sampler":
                names.append(saved["tinker_path"])
    return names


@asynccontextmanager
async def model_sub_job(
    service: Service, tinker: TinkerOps, owner: str | None, model: ModelRef, kind: str
) -> AsyncIterator[SubJob]:
    """The caller's running ``kind`` sub-job (``sampling`` or ``log_prob``) on ``model``'s
    weights, started on first use and waited for on the event loop (a request waiting for a
    model to start holds no worker thread); counted busy until the block ends, so it is not
    released under a request."""
    jobs = tinker.model_jobs
    sub_job_id = await run_in_threadpool(jobs.begin, None, owner, model.weights, kind)
    try:
        await running_info(service, parent_of(sub_job_id), owner=owner, timeout=STARTUP_TIMEOUT_S)
        yield service.resolve(sub_job_id, owner=owner)
    finally:  # off the loop: ``begin`` holds the registry's lock while it creates a job
        await run_in_threadpool(jobs.end, owner, model.weights, sub_job_id, kind)
