"""The lifecycle ops (``contract/job_ops.py``) as a Service runs them, and the long poll of a job.

The in-process and Ray backends send ``create-job``, ``get-job`` and ``cancel-job`` to a Service
like any op (``Service.execute``), answered here with the contract's result models
(``Service.get_job(wait_s=)`` holds a get-job on the caller's thread). The on-prem and Cortex
routes serve the same ops in their APIs' own answer shapes and hold a ``get-job`` with
:func:`settled_info`, which waits on the event loop rather than on a worker thread, so many
waiting clients cost no threads (each holds a connection, so a tenant's long polls waiting at
once are bounded: ``--max-long-polls-per-tenant``; one more is answered at once).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Annotated, Any

from fastapi import Query

from arctic_platform.contract.job_ops import JOB_OPS, MAX_WAIT_S, JobStatus
from arctic_platform.contract.ops import OpName
from arctic_platform.contract.states import STARTING_JOB_STATES
from arctic_platform.server.errors import TooManyRequests
from arctic_platform.server.op_bodies import parse

# How often a waiting get-job looks at its job's status again: every 20 ms at first, less often
# the longer it waits, up to twice a second, so thousands of waits (OpenAI requests on a model
# that is starting) cost the event loop little, while a quick start is seen at once.
JOB_POLL_S = 0.02
JOB_POLL_BACKOFF = 1.5
JOB_POLL_MAX_S = 0.5
# ``get-job``'s ``wait_s`` as the HTTP routes take it (``?wait_s=``), bounded as the body model.
WaitS = Annotated[float, Query(ge=0.0, le=MAX_WAIT_S)]


def run_job_op(service: Any, op: str, job_id: str, body: Any, *, owner: str | None) -> Any:
    """``op`` on ``service`` as the contract answers it (a dict, or None for cancel-job)."""
    if op == OpName.CREATE_JOB:
        status = JobStatus.from_info(service.create_job(body, owner=owner))
        return status.created().model_dump(mode="json")
    if op == OpName.GET_JOB:
        wait_s = parse(JOB_OPS[op].request, body, what=op).wait_s
        info = service.get_job(job_id, owner=owner, wait_s=wait_s)
        return JobStatus.from_info(info).model_dump(mode="json")
    if op == OpName.CANCEL_JOB:
        service.cancel_job(job_id, owner=owner)
        return None
    raise KeyError(f"{op!r} is not a job op")


async def running_info(service: Any, job_id: str, *, owner: str | None, timeout: float) -> dict:
    """``Service.wait_until_running`` on the event loop: the job's info once it runs; raises if
    it ends or ``timeout`` passes first. A route waiting for a job holds no worker thread, so
    requests waiting for slow starts cannot take the threads every other route runs on."""
    await settled_info(service, job_id, owner=owner, wait_s=timeout, waiting=nullcontext)
    return service.running_job_info(job_id, owner=owner, waited=timeout)


async def settled_info(
    service: Any,
    job_id: str,
    *,
    owner: str | None,
    wait_s: float,
    waiting: Callable[[], AbstractContextManager],
) -> dict:
    """The job's info once it is no longer starting, or after ``wait_s`` (a route's long poll,
    which holds ``waiting()`` while it waits: a slot among the tenant's long polls). With every
    slot taken it answers at once, as a server without long polls would: ``wait_s`` is how long
    the server may hold the answer, and clients pace their next get-job themselves."""
    deadline = time.monotonic() + wait_s
    info = service.get_job(job_id, owner=owner)
    if info["status"] not in STARTING_JOB_STATES or wait_s <= 0:
        return info
    with ExitStack() as slot:
        try:
            slot.enter_context(waiting())
        except TooManyRequests:
            return info
        interval = JOB_POLL_S
        while service.job_status(job_id, owner=owner) in STARTING_JOB_STATES:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(interval, left))
            interval = min(interval * JOB_POLL_BACKOFF, JOB_POLL_MAX_S)
    return service.get_job(job_id, owner=owner)
