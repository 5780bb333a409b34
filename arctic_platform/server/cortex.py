"""The Cortex/SnowAPI-compatible API under ``/api/v2/databases/{db}/schemas/{schema}/{endpoint}``.

Facts in reference/client_wire_api.md §2. The control plane (create, get, list, cancel, capacity,
checkpoints) answers at once; the data plane (forward-backward, forward-no-grad, generate,
log-probs, step, save, load, weight-sync) returns ``{"request_id", "job_id"}`` and the client polls
``GET requests/{rid}``. Octet bodies may arrive as request chunk groups, executed at most once per
group (see :mod:`arctic_platform.server.async_requests`).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response

from arctic_platform import wire
from arctic_platform.contract import ops as contract
from arctic_platform.contract.generate_columns import as_columns, wants_columns
from arctic_platform.contract.job_ops import JOB_OPS
from arctic_platform.contract.ops import BINARY_RESULTS, QUICK_OPERATIONS, GenerateBody, OpName
from arctic_platform.server.errors import BadRequest, NotFound, TooManyRequests
from arctic_platform.server.http_common import (
    frame_of,
    json_of,
    long_poll,
    off_loop,
    op_result,
    owner_of,
    read_body,
)
from arctic_platform.server.job_ops import WaitS, settled_info
from arctic_platform.server.op_bodies import parse
from arctic_platform.server.reference_logprobs import as_reference_logprobs, reference_samples

PREFIX = "/api/v2/databases/{database}/schemas/{schema}/{endpoint}"
EXPORT_TTL_S = 900
router = APIRouter(prefix=PREFIX)


def _service(request: Request):
    return request.app.state.service


# -- control plane ----------------------------------------------------------------------------


_CREATE = JOB_OPS[OpName.CREATE_JOB].cortex
_GET = JOB_OPS[OpName.GET_JOB].cortex
_CANCEL = JOB_OPS[OpName.CANCEL_JOB].cortex


@router.api_route(_CREATE.path, methods=[_CREATE.method])
async def create_job(request: Request) -> dict:
    owner = owner_of(request)
    body = await json_of(request, await read_body(request), what="create job")
    if isinstance(body, dict) and "job_id" in body:
        raise BadRequest("create job: job_id: the server chooses job ids; remove this field")
    info = await run_in_threadpool(_service(request).create_job, body, owner=owner)
    return {"job_id": info["job_id"]}


@router.get("")
async def list_jobs(request: Request, status: str | None = None) -> dict:
    return {"jobs": _service(request).list_jobs(owner=owner_of(request), status=status)}


@router.get("/capacity")
async def capacity(request: Request) -> dict:
    """The caller's share of the server; the operator's scrape credential sees every tenant's."""
    if request.app.state.metrics_auth.holds(request.headers.get("authorization")):
        return _service(request).capacity(every_tenant=True)
    return _service(request).capacity(owner=owner_of(request))


@router.api_route(_CANCEL.path, methods=[_CANCEL.method])
async def cancel_job(job_id: str, request: Request) -> dict:
    owner = owner_of(request)
    return await run_in_threadpool(_service(request).cancel_job, job_id, owner=owner)


@router.api_route(_GET.path, methods=[_GET.method])
async def get_job(job_id: str, request: Request, wait_s: WaitS = 0.0) -> dict:
    """The job's info; ``wait_s`` holds the answer while it starts (a long poll)."""
    service = _service(request)
    return await settled_info(
        service,
        job_id,
        owner=owner_of(request),
        wait_s=wait_s,
        waiting=functools.partial(long_poll, request),
    )


@router.get("/{job_id}/experiment-run")
async def experiment_run(job_id: str, request: Request) -> dict:
    info = _service(request).get_job(job_id, owner=owner_of(request))
    params = request.path_params
    name = info["experiment_name"] or "DEFAULT"
    return {
        "experiment_name": f"{params['database']}.{params['schema']}.{name}".upper(),
        "experiment_run_name": job_id,
    }


@router.get("/{job_id}/checkpoints")
async def list_checkpoints(job_id: str, request: Request) -> dict:
    return {"checkpoints": _service(request).list_checkpoints(job_id, owner=owner_of(request))}


@router.post("/{job_id}/checkpoints/{checkpoint_id}:export")
async def export_checkpoint(job_id: str, checkpoint_id: str, request: Request) -> dict:
    service, owner = _service(request), owner_of(request)
    files = await run_in_threadpool(service.checkpoint_files, job_id, checkpoint_id, owner=owner)
    base = str(request.url).rsplit(":export", 1)[0]
    expires = int(time.time()) + EXPORT_TTL_S
    listed = []
    for f in files:
        token = service.links.sign([job_id, checkpoint_id, f["filename"]], expires=expires)
        url = f"{base}/files/{f['filename']}?token={token}"
        listed.append({"filename": f["filename"], "url": url, "size_bytes": f["size_bytes"]})
    return {"checkpoint_id": checkpoint_id, "files": listed, "expires_at": expires}


@router.get("/{job_id}/checkpoints/{checkpoint_id}/files/{filename:path}")
async def download_checkpoint_file(
    job_id: str, checkpoint_id: str, filename: str, request: Request, token: str
) -> FileResponse:
    """Serve one exported file; the signed URL is the credential (like a presigned URL)."""
    service = _service(request)
    if service.links.verify(token) != [job_id, checkpoint_id, filename]:
        raise NotFound("download link not found")
    owner = service.owner_of(job_id)
    path = await run_in_threadpool(
        service.checkpoint_file, job_id, checkpoint_id, filename, owner=owner
    )
    return FileResponse(path, filename=Path(filename).name)


@router.delete("/{job_id}/checkpoints/{checkpoint_id}")
async def delete_checkpoint(job_id: str, checkpoint_id: str, request: Request) -> Response:
    owner = owner_of(request)
    await run_in_threadpool(_service(request).delete_checkpoint, job_id, checkpoint_id, owner=owner)
    return Response(status_code=204)


# -- data plane -------------------------------------------------------------------------------


async def _chunked_octet_op(request: Request, job_id: str, op: str) -> dict:
    """Octet body, possibly one chunk of a group: acknowledge, or schedule the whole frame."""
    owner = owner_of(request)
    service = _service(request)
    service.note_activity(job_id, owner=owner)  # a large body's upload keeps the job alive
    body = await read_body(request)
    # receive parses the body's header: a chunk's JSON is held to the limit like a whole frame's
    service.limits.check_json(f"{op}: DSSST1 header", wire.header_bytes(body))
    outcome = await run_in_threadpool(service.chunk_groups.receive, job_id, body, owner=owner)
    if outcome.request_id is not None:
        return {"request_id": outcome.request_id, "job_id": job_id}
    if outcome.frame is None:
        return {
            "job_id": job_id,
            "chunk_group_id": outcome.group_id,
            "received_chunks": outcome.received,
            "total_chunks": outcome.total,
        }
    try:
        payload, metadata = await frame_of(request, outcome.frame, what=op)
        if op == OpName.FORWARD and isinstance(payload, dict):
            payload.setdefault("reference_model", False)
        columns = op == OpName.GENERATE and wants_columns(metadata)
        reshape = as_columns if columns else None
        request_id = await off_loop(  # validated where it was decoded: off the loop when large
            len(outcome.frame), _submit, service, job_id, op, payload, owner, reshape=reshape
        )
    except TooManyRequests:
        # Refused for now: the client retries the last chunk, which submits the frame again.
        if outcome.group_id is not None:
            service.chunk_groups.unschedule(job_id, outcome.group_id)
        raise
    except BaseException:
        # Whatever went wrong, a retry of this group must get a definite answer, not wait on a
        # group that stays scheduled without a request.
        if outcome.group_id is not None:
            service.chunk_groups.forget(job_id, outcome.group_id)
        raise
    if outcome.group_id is not None:
        service.chunk_groups.completed(job_id, outcome.group_id, request_id)
    return {"request_id": request_id, "job_id": job_id}


# What turns a generate op's result into the reference's form (``generate``: ``{job_id, results}``;
# ``generate-stream``: the list of samples its events carry).
_REFERENCE_SHAPED = {
    OpName.GENERATE: as_reference_logprobs,
    OpName.GENERATE_STREAM: reference_samples,
}


def _submit(service, job_id: str, op: str, body: Any, owner: str | None, *, reshape=None) -> str:
    sub, op, body = service.dispatch(job_id, op, body, owner=owner)
    if reshape is None and op in _REFERENCE_SHAPED:  # the reference form: vLLM-shaped log-probs
        reshape = functools.partial(_REFERENCE_SHAPED[op], model_name=sub.spec.model_name)
    return _queue(service, job_id, sub, op, body, reshape=reshape)


def _queue(service, job_id: str, sub, op: str, body: Any, *, reshape=None) -> str:
    """Queue ``op`` on ``sub`` as an async request the client polls; its ``request_id``.
    ``reshape`` turns the op's result into the form the client asked for."""
    record = service.requests.track(
        lambda stop: service.submit(sub, op, body, stop=stop),
        job_id=job_id,
        sub_job_id=sub.sub_job_id,
        op=op,
        binary_result=op in BINARY_RESULTS,
        reshape=reshape,
    )
    return record.request_id


@router.post("/{job_id}/generate-stream")
async def generate_stream(job_id: str, request: Request) -> dict:
    owner = owner_of(request)
    raw = await read_body(request)
    body = await json_of(request, raw, what=OpName.GENERATE_STREAM)
    count = parse(GenerateBody, body, what=OpName.GENERATE_STREAM).samples
    op = OpName.GENERATE_STREAM
    request_id = await off_loop(len(raw), _submit, _service(request), job_id, op, body, owner)
    return {"request_id": request_id, "job_id": job_id, "count": count}


async def _json_op(request: Request, job_id: str, op: str) -> dict:
    owner = owner_of(request)
    raw = await read_body(request)
    body = await json_of(request, raw, what=op)
    # validated where it was decoded: off the event loop when large
    request_id = await off_loop(len(raw), _submit, _service(request), job_id, op, body, owner)
    return {"request_id": request_id, "job_id": job_id}


def _add_data_plane_route(spec: contract.Op) -> None:
    """``POST /{job}/{route}`` for an op of the table: octet ops take (chunked) DSSST1 frames,
    the others JSON; both answer ``{"request_id", "job_id"}``."""
    serve = _chunked_octet_op if spec.binary_request else _json_op

    async def route(job_id: str, request: Request) -> dict:
        return await serve(request, job_id, spec.name)

    route.__name__ = spec.name.replace("-", "_")
    router.add_api_route(f"/{{job_id}}/{spec.cortex_route}", route, methods=["POST"])


# Routes with their own checks are written out below; every other data-plane op comes from the
# op table.
_SPECIAL_ROUTES = {OpName.GENERATE_STREAM, OpName.LOAD_CHECKPOINT}
for _spec in contract.OPS.values():
    if _spec.cortex_route is not None and _spec.name not in _SPECIAL_ROUTES:
        _add_data_plane_route(_spec)


@router.post("/{job_id}/load")
async def load(job_id: str, request: Request) -> dict:
    owner = owner_of(request)
    body = await json_of(request, await read_body(request), what="load")
    if not isinstance(body, dict) or not body.get("checkpoint_id"):
        raise BadRequest("load: checkpoint_id is required", field="checkpoint_id")
    return {
        "request_id": _submit(_service(request), job_id, OpName.LOAD_CHECKPOINT, body, owner),
        "job_id": job_id,
    }


@router.post("/{job_id}/operation")
async def operation(job_id: str, request: Request) -> Any:
    owner = owner_of(request)
    service = _service(request)
    body = await json_of(request, await read_body(request), what="operation")
    sub, op, payload = service.dispatch(job_id, "operation", body, owner=owner)
    if sub is None:
        return service.inline_operation(job_id, op, payload, owner=owner)
    if op in QUICK_OPERATIONS:
        # Quick operations answer inline, as the Cortex API does for these types.
        return await op_result(service, sub, op, payload)
    return {"request_id": _queue(service, job_id, sub, op, payload), "job_id": job_id}


@router.get("/{job_id}/requests/{request_id}")
async def poll(
    job_id: str,
    request_id: str,
    request: Request,
    cursor: str | None = None,
    max_events: int | None = None,
) -> dict:
    # Collecting an op's result is its owner's use of the job (see Service.expire_idle_jobs).
    _service(request).note_activity(job_id, owner=owner_of(request))
    return _service(request).requests.poll(job_id, request_id, cursor=cursor, max_events=max_events)
