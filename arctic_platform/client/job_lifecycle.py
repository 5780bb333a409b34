"""A client's jobs, created or attached at construction and cancelled at close, on every backend.

The lifecycle is written once, here, as a short sequence of the job ops of
``contract/job_ops.py`` (create, get, cancel) sent through the client's transport like any op.
Transports only move those requests, spelt as their API spells them; none of them knows what a
client does with its jobs. So every backend creates, waits, attaches and cleans up the same way,
with the same errors:

* **create**: one ``create-job`` with the config's create-job body; then ``get-job`` on each job
  made until it runs (a long poll where the server offers one), ending in a 409 ``job_<state>``
  naming the reason if it fails first, or a :class:`RequestTimeoutError` after the backend's
  ``job_ready_timeout``. A job that made it this far but never ran is cancelled.
* **attach** (a config naming ``training_job_id``, ...): ``get-job`` on each id, waiting as above;
  a sub-job id its job does not hold is a 404. An attached client never cancels what it found.
* **close**: ``cancel-job`` on each job this client made (a job that already ended is left as
  it is).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import ValidationError

from arctic_platform.client.config import ArcticRLClientConfig
from arctic_platform.client.errors import (
    ArcticRLError,
    NotFoundError,
    RequestTimeoutError,
    ServerError,
    bad_response,
    server_error,
)
from arctic_platform.client.transport import JobHandles, Request, Transport
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.job_ops import JOB_OPS, JobStatus
from arctic_platform.contract.ops import OpName
from arctic_platform.contract.states import TERMINAL_JOB_STATES

log = logging.getLogger(__name__)
# How long one get-job may be held by a server while the job starts (well under any sensible
# request timeout).
LONG_POLL_S = 10.0
# Between get-job answers that came back with the job still starting: a server that honours the
# long poll has already waited, so these only pace one that does not.
POLL_INTERVAL_S = 0.2
POLL_BACKOFF = 1.5
POLL_MAX_INTERVAL_S = 5.0


class JobLifecycle:
    """Creates or attaches to the jobs of ``config`` through ``transport`` (module doc)."""

    def __init__(self, transport: Transport, config: ArcticRLClientConfig) -> None:
        self.transport = transport
        self.config = config
        self.created: list[str] = []

    def start(self) -> JobHandles:
        """The handles of the config's jobs, once they run. On failure, what was made is
        cancelled before the error is raised."""
        try:
            return self._attach() if self.config.reconnecting else self._create()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel the jobs this client made; idempotent. Failures are logged, not raised: the
        client is closing either way."""
        created, self.created = self.created, []
        for job_id in created:
            try:
                self.transport.call(Request(OpName.CANCEL_JOB, job_id))
            except ArcticRLError as exc:
                # A job that failed or was ended by the server has nothing left to release.
                ended = isinstance(exc, ServerError) and exc.status == 409
                level = logging.INFO if ended else logging.WARNING
                log.log(level, "could not cancel job %s: %s", job_id, exc)

    def _create(self) -> JobHandles:
        body = self.config.create_job_body()
        created = self._ask(Request(OpName.CREATE_JOB, "", body))
        self.created = list(created.job_ids)
        for job_id in created.job_ids:
            self._wait_running(job_id, op=OpName.CREATE_JOB)
        handles = JobHandles()
        for sub in created.sub_jobs:
            if getattr(handles, sub.job_type) is None:
                setattr(handles, sub.job_type, sub.sub_job_id)
        for role in self.config.jobs():
            if getattr(handles, role) is None:
                raise bad_response(
                    f"jobs {created.job_ids} have no {role} sub-job", op=OpName.CREATE_JOB
                )
        return handles

    def _attach(self) -> JobHandles:
        handles = JobHandles()
        for role, job_id in self.config.attach_ids().items():
            status = self._wait_running(job_id, op=OpName.GET_JOB)
            known = {sub.sub_job_id for sub in status.sub_jobs}
            if parent_of(job_id) != job_id and job_id not in known:
                raise NotFoundError(
                    f"sub-job {job_id!r} is not in job {status.job_id}",
                    status=404,
                    code="not_found",
                    op=OpName.GET_JOB,
                )
            setattr(handles, role, job_id)
        return handles

    def _wait_running(self, job_id: str, *, op: str) -> JobStatus:
        timeout = self.config.backend.job_ready_timeout
        deadline = time.monotonic() + timeout
        interval = POLL_INTERVAL_S
        while True:
            remaining = deadline - time.monotonic()
            body = {"wait_s": max(0.0, min(remaining, LONG_POLL_S))}
            status = self._ask(Request(OpName.GET_JOB, job_id, body))
            if status.status == "running":
                return status
            if status.status in TERMINAL_JOB_STATES:
                raise server_error(
                    409,
                    f"job_{status.status}",
                    f"job {status.job_id} is {status.status}: {status.reason}",
                    op=op,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"{op}: job {status.job_id} is still {status.status} after {timeout:.0f}s"
                )
            time.sleep(min(interval, remaining))
            interval = min(interval * POLL_BACKOFF, POLL_MAX_INTERVAL_S)

    def _ask(self, request: Request) -> Any:
        """``request``'s answer read as its job op's result model (``contract/job_ops.py``); a
        malformed one is a ``bad_response``."""
        value = self.transport.call(request)
        try:
            return JOB_OPS[request.op].result.model_validate(value)
        except ValidationError as exc:
            message = f"malformed answer: {exc.errors()[0]['msg']}: {str(value)[:200]}"
            raise bad_response(message, op=request.op) from None
