"""The on-prem job-management routes under ``/jobs`` (what ``arctic-platform jobs`` calls).

The on-prem op routes (``onprem.py``) address sub-jobs; an operator needs whole jobs: the list,
one job's configuration, sub-jobs, checkpoints and failure reason, its log, cancellation, and a
checkpoint's files. Every route is scoped to the caller's token: a tenant sees, cancels and
downloads only its own jobs, and another tenant's job id answers 404 like an unknown one.

``GET /jobs``, ``GET /jobs/{id}``, ``POST /jobs/{id}/cancel``, ``GET /jobs/{id}/logs``,
``GET /jobs/{id}/checkpoints``, ``GET /jobs/{id}/checkpoints/{ckpt}/files`` and
``GET /jobs/{id}/checkpoints/{ckpt}/files/{filename}`` (the file itself).
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse

from arctic_platform.server.http_common import owner_of

router = APIRouter(prefix="/jobs")
MAX_LOG_LINES = 1000


def _service(request: Request):
    return request.app.state.service


@router.get("")
async def list_jobs(request: Request, status: str | None = None) -> dict:
    """The caller's jobs, oldest first; ``now`` is the server's clock (ages are relative to it)."""
    jobs = _service(request).list_jobs(owner=owner_of(request), status=status)
    return {"jobs": jobs, "now": time.time()}


@router.get("/{job_id}")
async def show_job(job_id: str, request: Request) -> dict:
    """One job: its state and reason, sub-jobs, the request it was created from, checkpoints."""
    owner = owner_of(request)
    service = _service(request)
    info = service.get_job(job_id, owner=owner)
    return {
        **info,
        "config": service.job_request(job_id, owner=owner),
        "checkpoints": service.list_checkpoints(job_id, owner=owner),
        "now": time.time(),
    }


@router.post("/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request) -> dict:
    owner = owner_of(request)
    return await run_in_threadpool(_service(request).cancel_job, job_id, owner=owner)


@router.get("/{job_id}/logs")
async def job_logs(
    job_id: str,
    request: Request,
    cursor: str | None = None,
    max_lines: int = Query(200, ge=1, le=MAX_LOG_LINES),
) -> dict:
    """Log lines after ``cursor`` (``next_cursor`` continues; ``eof`` once the job has ended)."""
    return _service(request).tail_logs(
        job_id, owner=owner_of(request), cursor=cursor, max_lines=max_lines
    )


@router.get("/{job_id}/checkpoints")
async def job_checkpoints(job_id: str, request: Request) -> dict:
    return {"checkpoints": _service(request).list_checkpoints(job_id, owner=owner_of(request))}


@router.get("/{job_id}/checkpoints/{checkpoint_id}/files")
async def checkpoint_files(job_id: str, checkpoint_id: str, request: Request) -> dict:
    """A checkpoint's files by name (relative to the checkpoint) and size; no server paths."""
    service, owner = _service(request), owner_of(request)
    files = await run_in_threadpool(service.checkpoint_files, job_id, checkpoint_id, owner=owner)
    return {
        "checkpoint_id": checkpoint_id,
        "files": [{"filename": f["filename"], "size_bytes": f["size_bytes"]} for f in files],
    }


@router.get("/{job_id}/checkpoints/{checkpoint_id}/files/{filename:path}")
async def download_file(
    job_id: str, checkpoint_id: str, filename: str, request: Request
) -> FileResponse:
    """One file of a checkpoint; only names the checkpoint lists are served."""
    service, owner = _service(request), owner_of(request)
    path = await run_in_threadpool(
        service.checkpoint_file, job_id, checkpoint_id, filename, owner=owner
    )
    return FileResponse(path, filename=Path(filename).name)
