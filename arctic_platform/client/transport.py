"""What a transport is: one method that delivers an op, plus the lifecycle of the jobs behind it.

In the spirit of httpx's transports: the client owns everything op-specific (argument checking,
building bodies, shaping responses, the multi-call ``sync_weights`` sequence); a transport only
moves a :class:`Request` to wherever the engines run and hands back the decoded result. So a new
backend is one class, and the op surface is identical on all of them.

Job handles are sub-job ids (``{job}:{training|sampling|log_prob}:{i}``) on every backend: the
Service mints them, the on-prem ``/initialize`` route returns them, the Cortex job info lists them.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from arctic_platform.client.errors import JobNotConfiguredError
from arctic_platform.contract.ops import CLIENT_OPS, ROLES, Role
from arctic_platform.contract.ops import OPS as CONTRACT_OPS

# The canonical op names (the reference client's ``OPS``), from the op table.
OPS = CLIENT_OPS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """One op for one sub-job.

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
        if self.op not in OPS:
            raise ValueError(f"op: unknown op {self.op!r}; known: {sorted(OPS)}")
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

    @classmethod
    def from_sub_job_ids(cls, sub_job_ids: Iterable[str]) -> JobHandles:
        """The handles of a new job: the first sub-job of each role among its ``sub_job_ids``."""
        handles = cls()
        for sub_job_id in sub_job_ids:
            role = sub_job_id.split(":")[1]
            if getattr(handles, role) is None:
                setattr(handles, role, sub_job_id)
        return handles

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

    Lifecycle: :meth:`initialize` creates the configured jobs (or attaches to the ids a reconnect
    config names) and returns their handles; :meth:`shutdown` releases what this transport created
    and its connections; it is idempotent. Jobs a transport attached to are left running: whoever
    created them owns them.
    """

    jobs: JobHandles

    @abstractmethod
    def initialize(self) -> JobHandles:
        """Create or attach to the jobs; blocks until they run."""

    @abstractmethod
    def call(self, request: Request) -> Any:
        """Deliver ``request`` and return its decoded result; raise the client's errors."""

    async def acall(self, request: Request) -> Any:
        """Async delivery. The default runs :meth:`call` in a worker thread, so it works from
        any event loop (no connection is bound to a loop)."""
        return await asyncio.to_thread(self.call, request)

    @abstractmethod
    def shutdown(self) -> None:
        """Release the jobs this transport created and its connections; idempotent."""

    def get_server_state(self) -> Any:
        """What another client needs, besides the job ids, to attach to these jobs (None if
        nothing: the ids in ``reconnect_config()`` suffice)."""
        return None

    def reconnect_backend(self) -> Any:
        """The backend section a reconnecting client should use (None: the config's own). A
        transport that launched its server gives its actual address here."""
        return None


def initialize_or_cleanup(transport: Transport) -> JobHandles:
    """``transport.initialize()``; on failure, release what was created before re-raising."""
    try:
        return transport.initialize()
    except BaseException:
        try:
            transport.shutdown()
        except Exception as exc:  # the original error is the one worth raising
            log.warning("cleanup after a failed initialize also failed: %s", exc)
        raise
