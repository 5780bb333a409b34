"""The ops on a job's lifecycle: create it, get its state (to attach, or to wait until it runs),
cancel it. Their facts, written once.

A client drives them once for every backend (``client/job_lifecycle.py``): it creates or attaches
at construction and cancels what it created at close. A transport moves them like any other op,
spelt the way its API spells them (each op's on-prem and Cortex route below, which the routers
serve); a Service runs them directly for the in-process and Ray backends
(``server/job_ops.py``). Every transport answers with the same result models, so the client reads
one shape whatever the backend.

The on-prem API (the reference server's) creates one sub-job per ``/initialize`` call, each its
own job; the Cortex API and a Service create one job holding every sub-job. ``CreatedJob`` holds
either: the jobs made, and their sub-jobs by role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from arctic_platform.contract.job_config import SHORT_JOB_TYPE, CreateJobRequest
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.ops import OpName, Retry, Role
from arctic_platform.contract.states import JobState, cortex_name

# The longest a get-job may be held by a server while the job starts (a long poll).
MAX_WAIT_S = 60.0


@dataclass(frozen=True)
class Route:
    """How one API spells an op: method and path. A path naming ``{job_id}`` takes the job
    there; one that does not takes it as ``?job_id=`` (the on-prem API's way for every op)."""

    method: str
    path: str


@dataclass(frozen=True)
class JobOp:
    """The facts of one lifecycle op: its body and result models, routes and retry class."""

    name: OpName
    request: type[BaseModel] | None
    result: type[BaseModel] | None
    onprem: Route
    cortex: Route  # under the Cortex prefix (``/api/v2/databases/.../{endpoint}``)
    retry: Retry


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GetJobBody(_Model):
    """``wait_s``: while the job is still starting, a server may hold its answer this long, until
    the job runs or ends (a long poll, so a client waiting for a job need not poll fast). A
    server that does not honour it answers at once; the answer is the same either way."""

    wait_s: float = Field(0.0, ge=0.0, le=MAX_WAIT_S)


class SubJobRef(_Model):
    sub_job_id: str
    job_type: Role


class CreatedJob(_Model):
    """What ``create-job`` answers on every transport (module doc)."""

    job_ids: list[str] = Field(min_length=1)
    sub_jobs: list[SubJobRef] = Field(min_length=1)


# Other spellings of our states that Cortex servers use.
_STATE_SPELLINGS: dict[str, JobState] = {"canceled": "cancelled", "done": "terminated"}


class JobStatus(_Model):
    """What ``get-job`` answers on every transport: the job's state, why, and its sub-jobs."""

    job_id: str
    status: JobState
    reason: str | None = None
    sub_jobs: list[SubJobRef]

    @classmethod
    def from_info(cls, info: Any) -> JobStatus:
        """From a job's info as the Service and the Cortex API give it (``{job_id, status,
        reason, sub_jobs: [{sub_job_id, job_type}]}``; Cortex's ``JOB_STATE_``/``JOB_TYPE_``
        spellings and a ``{"job": ...}`` wrapper are read too). Raises ``ValueError`` naming
        what is missing."""
        if isinstance(info, dict) and isinstance(info.get("job"), dict):
            info = info["job"]
        if not isinstance(info, dict):
            raise ValueError(f"a job's info must be an object, got {type(info).__name__}")
        status = cortex_name(info.get("status"), "job_state_")
        subs = [
            {
                "sub_job_id": str(sub.get("sub_job_id")),
                "job_type": SHORT_JOB_TYPE.get(cortex_name(sub.get("job_type"), "job_type_")),
            }
            for sub in info.get("sub_jobs") or []
            if isinstance(sub, dict)
        ]
        return cls.model_validate(
            {
                "job_id": str(info.get("job_id")),
                "status": _STATE_SPELLINGS.get(status, status),
                "reason": info.get("reason"),
                "sub_jobs": subs,
            }
        )

    @classmethod
    def from_onprem(cls, info: Any) -> JobStatus:
        """From the on-prem ``GET /job/{id}`` answer (one sub-job: ``{job_id, parent_job_id,
        job_type, status, reason}``)."""
        if not isinstance(info, dict):
            raise ValueError(f"a job's info must be an object, got {type(info).__name__}")
        sub_id = str(info.get("job_id"))
        return cls.from_info(
            {
                "job_id": info.get("parent_job_id") or parent_of(sub_id),
                "status": info.get("status"),
                "reason": info.get("reason"),
                "sub_jobs": [{"sub_job_id": sub_id, "job_type": info.get("job_type")}],
            }
        )

    def created(self) -> CreatedJob:
        """This job as a ``create-job`` answer."""
        return CreatedJob(job_ids=[self.job_id], sub_jobs=self.sub_jobs)


_TABLE = (
    JobOp(
        OpName.CREATE_JOB,
        CreateJobRequest,
        CreatedJob,
        onprem=Route("POST", "/initialize"),
        cortex=Route("POST", ""),
        retry="never",
    ),
    JobOp(
        OpName.GET_JOB,
        GetJobBody,
        JobStatus,
        onprem=Route("GET", "/job/{job_id}"),
        cortex=Route("GET", "/{job_id}"),
        retry="safe",
    ),
    JobOp(
        OpName.CANCEL_JOB,
        None,
        None,
        onprem=Route("POST", "/destroy"),
        cortex=Route("POST", "/{job_id}:cancel"),
        retry="never",
    ),
)
JOB_OPS: dict[str, JobOp] = {op.name: op for op in _TABLE}
