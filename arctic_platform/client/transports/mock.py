"""``MockTransport``: a client whose ops are answered by a function, as ``httpx.MockTransport``.

For tests of code that drives a client (a framework adapter, a training loop): every
:class:`~arctic_platform.client.transport.Request` the client builds (op name, sub-job id, body,
frame metadata) is handed to ``handler``, whose return value is the op's raw result, shaped by
the client exactly as a server's would be. No engine, server or network is involved. The job ops
(``create-job``, ``get-job``, ``cancel-job``) are answered by the mock itself, as a server
running the jobs ``jobs`` names would answer them, and recorded in ``job_requests``::

    def handler(request):
        assert request.op == "step"
        return {"job_id": request.job_id, "global_steps": 1, "last_lr": 1e-5, "grad_norm": 0.5}

    client = SyncArcticRLClient(config, transport=MockTransport(handler))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from arctic_platform.client.errors import ArcticRLError
from arctic_platform.client.transport import JobHandles, Request, Transport
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.job_ops import JOB_OPS, JobStatus
from arctic_platform.contract.ops import OpName


class MockTransport(Transport):
    """Answers every op with ``handler(request)``, the job ops from ``jobs``; ``on_close`` runs
    once at close."""

    def __init__(
        self,
        handler: Callable[[Request], Any],
        *,
        jobs: JobHandles | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.handler = handler
        self.jobs = jobs or JobHandles(
            training="mock:training:0", sampling="mock:sampling:0", log_prob="mock:log_prob:0"
        )
        self.requests: list[Request] = []
        self.job_requests: list[Request] = []
        self._on_close = on_close
        self.closed = False

    def call(self, request: Request) -> Any:
        if self.closed:
            raise ArcticRLError(f"{request.op}: the transport was shut down")
        if request.op in JOB_OPS:
            self.job_requests.append(request)
            return self._job_answer(request)
        self.requests.append(request)
        return self.handler(request)

    def _job_answer(self, request: Request) -> Any:
        subs = [{"sub_job_id": job_id, "job_type": role} for role, job_id in self.jobs.items()]
        if request.op == OpName.CANCEL_JOB:
            return None
        status = JobStatus(job_id=parent_of(subs[0]["sub_job_id"]), status="running", sub_jobs=subs)
        return (status.created() if request.op == OpName.CREATE_JOB else status).model_dump()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._on_close is not None:
                self._on_close()
