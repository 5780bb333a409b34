"""The exceptions the client raises, the same on every backend.

A framework catches one family, whatever the transport: the in-process transport converts the
Service's own errors, the HTTP transports convert error responses (``{"message", "code"}`` bodies)
and connection failures. Raw ``httpx`` exceptions never escape the client.

* :class:`ServerError` carries the server's ``status`` (HTTP status), ``code`` (a stable name such
  as ``invalid_argument`` or ``chunk_group_conflict``) and ``message``. Bad input is an
  :class:`InvalidRequestError`, which is also a ``ValueError``.
* :class:`TransportError` means the server could not be reached or the connection broke after the
  retries were spent; :class:`RequestTimeoutError` that a job or request did not finish in time.
* :class:`JobNotConfiguredError` means an op needs a job (sampling, log-prob) the client's config
  does not create.
"""

from __future__ import annotations

from typing import Any


class ArcticRLError(Exception):
    """Base class of every error the client raises."""


class ServerError(ArcticRLError):
    """The server refused or failed an op: ``status``, ``code`` and ``message`` say why."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None,
        code: str | None,
        op: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        where = f"{op}: " if op and not message.startswith(f"{op}:") else ""
        label = " ".join(str(p) for p in (status, code) if p is not None)
        super().__init__(f"{where}{message}" + (f" [{label}]" if label else ""))
        self.message = message
        self.status = status
        self.code = code
        self.op = op
        self.details = details or {}


class InvalidRequestError(ServerError, ValueError):
    """The server rejected the request's content (400, 413, 422); nothing changed on the server."""


class AuthenticationError(ServerError):
    """Missing or wrong credentials (401, 403)."""


class NotFoundError(ServerError):
    """Unknown job, sub-job, request or checkpoint (404)."""


class ConflictError(ServerError):
    """The request clashes with the job's state or with an earlier request (409)."""


class ChunkGroupError(ConflictError):
    """A request chunk group was refused (``chunk_group_conflict``, ``..._missing_chunks``, or a
    ``..._restart_required`` that persisted after the one allowed replay)."""


class TransportError(ArcticRLError, ConnectionError):
    """The server could not be reached, or the connection broke, after the retries were spent."""


class RequestTimeoutError(ArcticRLError, TimeoutError):
    """A job did not start, or an asynchronous request did not finish, within its timeout."""


class JobNotConfiguredError(ArcticRLError, ValueError):
    """The op needs a job (training, sampling or log-prob) this client has not created."""


class BackendUnavailableError(ArcticRLError, RuntimeError):
    """The configured backend cannot run here (not implemented yet, or its server is missing)."""


_BY_STATUS: dict[int, type[ServerError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    413: InvalidRequestError,
    422: InvalidRequestError,
}


def bad_response(message: str, *, op: str | None) -> ServerError:
    """The error for an answer the client cannot read (not the shape the API promises): a
    :class:`ServerError` with code ``bad_response`` and no status."""
    return ServerError(message, status=None, code="bad_response", op=op)


def server_error(
    status: int | None,
    code: str | None,
    message: str,
    *,
    op: str | None = None,
    details: dict[str, Any] | None = None,
) -> ServerError:
    """The exception for an error response: its class follows the status (and chunk codes)."""
    if code is not None and code.startswith("chunk_group_"):
        cls: type[ServerError] = ChunkGroupError
    else:
        cls = _BY_STATUS.get(status or 0, ServerError)
    return cls(message, status=status, code=code, op=op, details=details)
