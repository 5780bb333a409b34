"""The on-prem HTTP API: synchronous ops addressed by ``?job_id=``.

Routes follow the reference on-prem server (reference/server_engines_losses.md §3):
``/health``, ``/status``, ``/initialize`` (one sub-job per call, returns when its engine is
ready), ``/job/{id}``, ``/destroy`` and ``POST /{op}?job_id=`` for every op. Tensor bodies
(forward-backward, forward, generate) are DSSST1; tensor results come back as DSSST1,
everything else as JSON.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from arctic_platform.contract.generate_columns import as_columns, wants_columns
from arctic_platform.contract.job_config import SHORT_JOB_TYPE
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.job_ops import JOB_OPS
from arctic_platform.contract.ops import BINARY_RESULTS, ONPREM_OPS, OpName
from arctic_platform.server.errors import BadRequest, NotFound
from arctic_platform.server.http_common import (
    frame_response,
    json_of,
    long_poll,
    off_loop,
    owner_of,
    read_body,
    read_op_body,
)
from arctic_platform.server.job_ops import WaitS, running_info, settled_info
from arctic_platform.server.reference_logprobs import as_reference_logprobs
from arctic_platform.server_identity import health_answer

router = APIRouter()
# Fields of the reference server's JobConfig (the form the reference client's /initialize sends).
# A body with any of them is read as the client reads the same legacy fields (both fold them as
# :mod:`arctic_platform.contract.legacy_config` says): optimizer, clipping, scheduler, token
# budget and attention are honoured, and ``checkpoint_path`` is a training job's default
# checkpoint root; what has no meaning here is reported back as ``ignored_settings``.
REFERENCE_INIT_FIELDS = frozenset(
    {
        "num_devices",
        "ds_config",
        "log_prob_config",
        "ds_worker_config",
        "arctic_inference_config",
        "full_determinism",
        "checkpoint_path",
        "cuda_ipc",
        "low_memory",
    }
)
STARTUP_TIMEOUT_S = 1800.0


def _service(request: Request):
    return request.app.state.service


@router.get("/health")
async def health(request: Request) -> dict:
    """Liveness plus identity (:mod:`arctic_platform.server_identity`), so a launcher knows
    the process answering is the server it started."""
    return health_answer(request.app.state.instance)


@router.get("/status")
async def status(request: Request) -> dict:
    owner = owner_of(request)
    jobs = _service(request).list_jobs(owner=owner)
    subs = {s["sub_job_id"]: _onprem_info(j, s) for j in jobs for s in j["sub_jobs"]}
    service = _service(request)
    running = service.running_ops(owner)
    return {"device": service.settings.device, "jobs": subs, "running_ops": running}


_CREATE = JOB_OPS[OpName.CREATE_JOB].onprem
_GET = JOB_OPS[OpName.GET_JOB].onprem
_CANCEL = JOB_OPS[OpName.CANCEL_JOB].onprem


@router.api_route(_CREATE.path, methods=[_CREATE.method])
async def initialize(request: Request) -> dict:
    """Create a job with one sub-job and wait until its engine is ready (as the reference does)."""
    owner = owner_of(request)
    body = await json_of(request, await read_body(request), what="initialize")
    service = _service(request)
    writable = functools.partial(service.paths.writable, owner)
    spec, ignored = await run_in_threadpool(_sub_job_from_init, body, writable)
    info = await run_in_threadpool(service.create_job, {"sub_job_configs": [spec]}, owner=owner)
    await running_info(service, info["job_id"], owner=owner, timeout=STARTUP_TIMEOUT_S)
    sub = info["sub_jobs"][0]
    answer = {"job_id": sub["sub_job_id"], "job_type": spec["job_type"], "running": True}
    if ignored:
        answer["ignored_settings"] = ignored
    return answer


@router.api_route(_GET.path, methods=[_GET.method])
async def get_job(job_id: str, request: Request, wait_s: WaitS = 0.0) -> dict:
    """The sub-job's state; ``wait_s`` holds the answer while its job starts (a long poll)."""
    service = _service(request)
    info = await settled_info(
        service,
        job_id,
        owner=owner_of(request),
        wait_s=wait_s,
        waiting=functools.partial(long_poll, request),
    )
    for sub in info["sub_jobs"]:
        if sub["sub_job_id"] == job_id or ":" not in job_id:
            return _onprem_info(info, sub)
    raise NotFound(f"job {job_id!r} not found")


@router.api_route(_CANCEL.path, methods=[_CANCEL.method])
async def destroy(request: Request, job_id: str) -> dict:
    owner = owner_of(request)
    await read_body(request)  # {"job_type"} is required by the reference client, unused here
    await run_in_threadpool(_service(request).cancel_job, parent_of(job_id), owner=owner)
    return {"job_id": job_id}


@router.post("/{op}")
async def run_op(
    op: str, request: Request, job_id: str, level: int | None = None, mode: str | None = None
) -> Any:
    if op not in ONPREM_OPS:
        raise NotFound(f"unknown op {op!r}; known: {sorted(ONPREM_OPS)}")
    owner = owner_of(request)
    body, frame_metadata, nbytes = await read_op_body(request, what=op)
    if op == OpName.SLEEP_INFERENCE and level is not None and body is None:
        body = {"level": level}
    if op == OpName.SLEEP_TRAINING and mode is not None and body is None:
        body = {"mode": mode}
    # validated (and measured) where it was decoded: off the event loop when large
    started = await off_loop(nbytes, _service(request).start, job_id, op, body, owner=owner)
    result = await asyncio.wrap_future(started.future)
    if started.op == OpName.GENERATE:  # columns when asked for, else the reference form
        reshape = (
            as_columns
            if wants_columns(frame_metadata)
            else functools.partial(as_reference_logprobs, model_name=started.sub.spec.model_name)
        )
        result = await run_in_threadpool(reshape, result)
    return frame_response(result) if started.op in BINARY_RESULTS else result


def _onprem_info(job: dict, sub: dict) -> dict:
    return {
        "job_id": sub["sub_job_id"],
        "parent_job_id": job["job_id"],
        "job_type": SHORT_JOB_TYPE[sub["job_type"]],
        "model_name": sub["model_name"],
        "status": job["status"].upper(),
        "reason": job["reason"],
    }


def _sub_job_from_init(body: Any, writable: Callable[..., Path]) -> tuple[dict, dict]:
    """The reference ``JobConfig`` (or our sub-job config) as ``(sub-job config, ignored)``;
    ``writable(path, field=)`` checks a folder the caller may save in (the server's paths)."""
    if not isinstance(body, dict):
        raise BadRequest("initialize: body must be a JSON object")
    if REFERENCE_INIT_FIELDS & set(body):
        return _fold_reference_job(body, writable)
    spec = dict(body)
    spec.setdefault("job_type", "training")
    vllm = spec.pop("vllm_config", None)
    if vllm is not None:
        if spec["job_type"] == "training":
            raise BadRequest("initialize: vllm_config applies to sampling and log_prob jobs")
        spec.setdefault("inference_config", {})["vllm_config"] = vllm
    return spec, {}


def _fold_reference_job(body: dict, writable: Callable[..., Path]) -> tuple[dict, dict]:
    """A reference ``JobConfig`` through the contract's legacy folding (see REFERENCE_INIT_FIELDS).

    ``checkpoint_path`` is, as on the reference server, the root where a training job saves and
    loads when a call names no path: it becomes the sub-job's ``checkpoint_dir`` once
    ``writable`` accepts it (a 400 naming ``checkpoint_path`` otherwise, before any job exists).
    """
    from pydantic import ValidationError

    from arctic_platform.contract.job_sections import JobsConfig
    from arctic_platform.server.op_bodies import describe

    job_type = body.get("job_type", "training")
    role = SHORT_JOB_TYPE.get(job_type) if isinstance(job_type, str) else None
    if role is None:
        raise BadRequest(f"initialize: job_type: unknown {job_type!r}")
    devices = body.get("num_devices") or 1
    flat = {f"{r}_gpus": devices if r == role else 0 for r in ("training", "sampling", "log_prob")}
    ignored: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("job_type", "num_devices") or value is None:
            continue
        # log_prob_config: a DeepSpeed log-prob job's; checkpoint_path: only a trainer saves.
        if key == "log_prob_config" or (key == "checkpoint_path" and role != "training"):
            ignored[key] = value
        elif key == "checkpoint_path":
            continue  # placed below, once the rest of the config is valid
        else:
            flat[key] = value
    try:
        config = JobsConfig.model_validate(flat)
    except ValidationError as exc:
        raise BadRequest(f"initialize: {describe(exc)}") from None
    (spec,) = config.sub_job_configs()
    if role == "training" and body.get("checkpoint_path") is not None:
        root = writable(body["checkpoint_path"], field="checkpoint_path")
        spec["training_config"]["checkpoint_dir"] = str(root)
    return spec, {**config.ignored_settings, **ignored}
