"""What a transport is: it opens a connection, delivers ops, and closes; nothing else.

In the spirit of httpx's transports: the client owns everything op-specific (argument checking,
building bodies, shaping responses, the multi-call ``sync_weights`` sequence) and the jobs'
lifecycle (``client/job_lifecycle.py`` drives the job ops ``create-job``, ``get-job`` and
``cancel-job`` once for every backend); a transport only moves a :class:`Request` to wherever the
engines run and hands back the decoded result. So a new backend is one class, and the op surface
is identical on all of them.

Job handles are sub-job ids (``{job}:{training|sampling|log_prob}:{i}``) on every backend: the
Service mints them, the on-prem ``/initialize`` route returns them, the Cortex job info lists them.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from arctic_platform.client.errors import JobNotConfiguredError
from arctic_platform.contract.job_ops import JOB_OPS
from arctic_platform.contract.ops import CLIENT_OPS, ROLES, Role
from arctic_platform.contract.ops import OPS as CONTRACT_OPS

# The canonical op names (the reference client's ``OPS``), from the op table.
OPS = CLIENT_OPS


@dataclass(frozen=True)
class Request:
    """One op for one sub-job (or, for a job op, one job: ``job_id`` is empty for ``create-job``).

    ``body`` is the op's body as the server validates it (a dict; ``wake-inference`` also takes a
    tag list or None). ``binary`` says the body carries tensors and travels as a DSSST1 frame
    (by default: what the op table says of the op); ``frame_metadata`` is the op metadata that
    frame carries (response options).
    """

    op: str
    job_id: str
    body: Any = field(default_factory=dict)
    binary: bool | None = None
    frame_metadata: dict | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS and self.op not in JOB_OPS:
            known = sorted({*OPS, *JOB_OPS})
            raise ValueError(f"op: unknown op {self.op!r}; known: {known}")
        if self.binary is None:
            spec = CONTRACT_OPS.get(self.op)
            object.__setattr__(self, "binary", spec is not None and spec.binary_request)


@dataclass
class JobHandles:
    """The sub-job ids of a client's jobs; ``None`` for a job the config does not create."""

    training: str | None = None
    sampling: str | None = None
    log_prob: str | None = None

    def require(self, role: Role) -> str:
        """The id of the ``role`` job, or a :class:`JobNotConfiguredError` saying how to add it."""
        job_id = getattr(self, role)
        if job_id is None:
            section = "log_prob" if role == "log_prob" else role
            raise JobNotConfiguredError(
                f"this client has no {role} job; add a `{section}:` section to its config "
                f"(or pass {role}_job_id= to attach to a running one)"
            )
        return job_id

    def role_of(self, job_id: str) -> Role | None:
        """Which of this client's jobs ``job_id`` is."""
        for role in ROLES:
            if getattr(self, role) == job_id:
                return role
        return None

    def items(self) -> list[tuple[Role, str]]:
        """``(role, id)`` of the jobs that exist."""
        return [(role, getattr(self, role)) for role in ROLES if getattr(self, role) is not None]


class Transport(ABC):
    """Delivers ops to the engines of one backend.

    :meth:`open` connects (starting a local server, a Service or a Ray actor where the backend
    says so), :meth:`call` delivers one request, job ops included, and :meth:`close` releases the
    connection and what :meth:`open` started; it is idempotent. Which jobs exist is not a
    transport's business (``client/job_lifecycle.py``).
    """

    def open(self) -> None:  # noqa: B027 - most transports connect in __init__
        """Connect; called once before the first request."""

    @abstractmethod
    def call(self, request: Request) -> Any:
        """Deliver ``request`` and return its decoded result; raise the client's errors."""

    async def acall(self, request: Request) -> Any:
        """Async delivery. The default runs :meth:`call` in a worker thread, so it works from
        any event loop (no connection is bound to a loop)."""
        return await asyncio.to_thread(self.call, request)

    @abstractmethod
    def close(self) -> None:
        """Release the connection and what :meth:`open` started; idempotent."""

    def get_server_state(self) -> Any:
        """What another client needs, besides the job ids, to attach to these jobs (None if
        nothing: the ids in ``reconnect_config()`` suffice)."""
        return None

    def reconnect_backend(self) -> Any:
        """The backend section a reconnecting client should use (None: the config's own). A
        transport that launched its server gives its actual address here."""
        return None
