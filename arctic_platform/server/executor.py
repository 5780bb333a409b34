"""Where and how an op runs: routing it to a sub-job, its queue, and the guard around it.

The ops on one sub-job run in arrival order, one at a time, except ``generate`` on an engine with a
running batch (``concurrent_generate``): those run side by side, joining one decode, while every
other op of the sub-job waits for them and they for it (``sub_job_queue.SubJobQueue``). A
server-wide ``FairSlots`` bounds how many run at once across jobs and tenants; each generate
takes its own slot, metrics and error guard, as any op. The guard
decides what an op's failure costs: bad input, a missing checkpoint, a refused checkpoint write
and a stop fail only the request, anything else fails the job. What an op *does* is ``ops.py``
(and Tinker's runners); this module only runs it.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from arctic_platform.contract.job_config import SHORT_JOB_TYPE
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.ops import INLINE_OPERATIONS, OPERATION, OPERATION_TYPES, OPS, OpName
from arctic_platform.contract.problems import FieldError
from arctic_platform.engine import cancellation
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.server.async_requests import RequestStore
from arctic_platform.server.errors import (
    BadRequest,
    Conflict,
    EngineFailure,
    NotFound,
    ServiceError,
    checkpoint_write_failure,
    result_of,
)
from arctic_platform.server.job_registry import Job, JobRegistry, SubJob
from arctic_platform.server.metrics import ServiceMetrics
from arctic_platform.server.paths import PathPolicy
from arctic_platform.server.scheduler import FairSlots


class OpExecutor:
    """Routes ops to sub-jobs, queues them, and runs each under the slots and the error guard."""

    def __init__(
        self,
        jobs: JobRegistry,
        slots: FairSlots,
        metrics: ServiceMetrics,
        paths: PathPolicy,
        requests: RequestStore,
    ) -> None:
        self.jobs = jobs
        self.slots = slots
        self.metrics = metrics
        self.paths = paths
        self.requests = requests

    def dispatch(
        self, target: str, op: str, body: Any, *, owner: str | None
    ) -> tuple[SubJob | None, str, Any]:
        """Where ``op`` runs: ``(sub_job, op, body)``, with ``operation`` envelopes unwrapped.

        ``target`` is a sub-job id, or a job id (the op's natural sub-job type is then used).
        Inline operations (``cancel-request``, ``tail-logs``) come back with ``sub_job=None``.
        """
        from arctic_platform.contract.ops import OperationBody
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
                self.jobs.get(target, owner)
                return None, op, body
            if envelope.sub_job_type is not None and envelope.sub_job_type not in SHORT_JOB_TYPE:
                raise BadRequest(f"operation: unknown sub_job_type {envelope.sub_job_type!r}")
            if envelope.sub_job_id is not None:
                sub = self.jobs.resolve(str(envelope.sub_job_id), owner=owner)
                if envelope.sub_job_type and SHORT_JOB_TYPE[envelope.sub_job_type] != sub.kind:
                    raise BadRequest(
                        f"operation: sub_job_id {envelope.sub_job_id} is not a "
                        f"{envelope.sub_job_type} sub-job"
                    )
                return sub, op, body
            if envelope.sub_job_type is not None:
                return (
                    self.jobs.resolve(
                        target, owner=owner, kind=SHORT_JOB_TYPE[envelope.sub_job_type]
                    ),
                    op,
                    body,
                )
        if ":" in target:
            return self.jobs.resolve(target, owner=owner), op, body
        return self.jobs.resolve(target, owner=owner, kind=op_kind(op, body)), op, body

    def inline_operation(self, target: str, op: str, body: Any, *, owner: str | None) -> dict:
        """Operations answered at once, without entering a queue."""
        from arctic_platform.contract.ops import CancelRequestBody, TailLogsBody
        from arctic_platform.server.op_bodies import parse

        job_id = parent_of(target)
        if op == OpName.CANCEL_REQUEST:
            parsed = parse(CancelRequestBody, body, what=OpName.CANCEL_REQUEST)
            return self.requests.cancel(job_id, parsed.request_id)
        parsed = parse(TailLogsBody, body, what=OpName.TAIL_LOGS)
        return self.jobs.tail_logs(
            job_id, owner=owner, cursor=parsed.cursor, max_lines=parsed.max_lines
        )

    def submit_runner(
        self,
        sub: SubJob,
        op: str,
        runner: Callable[[], Any],
        *,
        stop: CancelToken | None = None,
        alone: bool = False,
    ) -> Future:
        """Queue ``runner`` (already validated) on ``sub`` under the name ``op``: queue order,
        the concurrency slots and failure handling (``_guarded``), as for the Service's
        ``submit``; the Tinker API queues the runners it builds over the engines this way.
        ``stop`` cancels this op alone, as ``job.stop`` cancels every op of the job. A generate
        overlaps others (:meth:`overlaps`) unless ``alone`` (it does more than generate)."""
        job = self.jobs.get(sub.job_id, None, check_owner=False)
        stops = (job.stop,) if stop is None else (job.stop, stop)
        shared = not alone and self.overlaps(sub, op)
        return self._enqueue(job, sub, self._guarded, job, sub, op, runner, stops, shared=shared)

    @staticmethod
    def overlaps(sub: SubJob, op: str) -> bool:
        """Whether ``op`` runs beside the sub-job's other such ops: a generate on an engine whose
        running batch decodes concurrent calls together (see the module doc)."""
        if op != OpName.GENERATE or sub.kind != "sampling" or sub.engine is None:
            return False
        return sub.engine.concurrent_generate

    def run_on(self, sub: SubJob, fn, *args) -> Any:
        """Run ``fn`` on another sub-job's queue and wait (weight sync touches two engines).

        The target job counts it as its own op: it must be running (a Conflict otherwise,
        which leaves the calling job healthy), and the idle expiry sees it busy, then used."""
        target = self.jobs.get(sub.job_id, None, check_owner=False)
        future = self._enqueue(target, sub, fn, *args)
        try:
            return result_of(future)
        finally:
            target.last_active_at = time.time()

    def _enqueue(self, job: Job, sub: SubJob, fn, *args, shared: bool = False) -> Future:
        """Queue ``fn(*args)`` on ``sub`` as an op of ``job``: the job must be running, and it is
        busy (``in_flight``) until the op ends. Under the lock, so the idle expiry sees the job
        either idle or busy, never between."""
        with self.jobs.lock:
            self.jobs.require_running(job)
            if sub.queue is None:
                raise Conflict(f"sub-job {sub.sub_job_id} has no engine", code="job_not_running")
            job.last_active_at = time.time()
            future = sub.queue.submit(fn, *args, shared=shared)
            job.in_flight.add(future)
        future.add_done_callback(lambda f: self._op_done(job, f))
        return future

    def _op_done(self, job: Job, future: Future) -> None:
        with self.jobs.lock:
            job.in_flight.discard(future)

    def _guarded(
        self, job: Job, sub: SubJob, op: str, runner, stops: tuple[CancelToken, ...]
    ) -> Any:
        """Run ``runner`` as ``op`` of ``job``: bad input, a missing checkpoint, a refused
        checkpoint write and a stop fail only the request. So does any other exception of an op
        that keeps its engine's state (``Op.keeps_engine_state``) unless it broke the engine
        (``engine.errors.breaks_engine``): it is raised as it is, for each surface's one answer
        to an exception nobody anticipated. Anything else fails the job. Messages name paths as
        the owner may see them (``PathPolicy.redact``)."""
        from arctic_platform.engine.errors import (
            CheckpointNotFound,
            CheckpointWriteError,
            SamplerStateError,
            breaks_engine,
        )

        redact = partial(self.paths.redact, job.owner)

        if job.cancelled.is_set():
            raise Conflict(f"job {job.job_id} was cancelled", code="job_cancelled")
        with self.slots.slot(job.owner), self.metrics.op(op):
            self.jobs.require_running(job)
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
                self.jobs.log(job, f"{op} failed on {sub.sub_job_id}: {exc}")
                raise checkpoint_write_failure(op, exc.errno, redact(str(exc))) from None
            except SamplerStateError as exc:
                # A weight sync failed part-way: the job is healthy once a full sync succeeds.
                raise Conflict(f"{op}: {exc}", code="weights_incomplete") from None
            except Exception as exc:
                reason = redact(f"{op} failed on {sub.sub_job_id}: {type(exc).__name__}: {exc}")
                spec = OPS.get(op)
                if spec is not None and spec.keeps_engine_state and not breaks_engine(exc):
                    # The engine is as it was: only the request fails, answered as each surface
                    # answers an exception nobody anticipated (a 500 naming its request id).
                    self.jobs.log(job, f"{reason}; the job goes on")
                    raise
                self.jobs.log(job, reason + "\n" + traceback.format_exc(limit=8))
                self.jobs.fail(job, reason)
                raise EngineFailure(reason) from exc
            finally:  # before the caller sees the result: the idle clock starts at the op's end
                job.last_active_at = time.time()
