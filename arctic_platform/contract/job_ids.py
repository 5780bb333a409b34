"""How a sub-job id is spelt: ``{job}:{role}:{index}``, minted by the server, read everywhere.

Every API hands out sub-job ids as job handles (the on-prem ``/initialize`` answer, the Cortex
job info, the in-process and Ray Services), and a route that takes a job id takes a sub-job id
too, meaning its job. These three functions are the only place the spelling is written.
"""

from __future__ import annotations

from arctic_platform.contract.ops import ROLES, Role


def sub_job_id(job_id: str, role: Role, index: int) -> str:
    """The id of the ``index``-th ``role`` sub-job of job ``job_id``."""
    return f"{job_id}:{role}:{index}"


def parent_of(job_or_sub_job_id: str) -> str:
    """The job a sub-job id belongs to (a job id is its own parent)."""
    return str(job_or_sub_job_id).split(":", 1)[0]


def role_of(job_or_sub_job_id: str) -> Role | None:
    """The role a sub-job id names; None for a job id (or an id not spelt by this server)."""
    parts = str(job_or_sub_job_id).split(":")
    if len(parts) == 3 and parts[1] in ROLES:
        return parts[1]  # type: ignore[return-value]
    return None
