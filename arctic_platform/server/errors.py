"""Errors the Service raises, each with the HTTP status and the Cortex error code it maps to.

The Service is transport-agnostic: the in-process transport sees these exceptions directly, the
HTTP routers turn them into ``{"message", "code"}`` bodies with the same status. Every error that
comes from bad input says which field is wrong, and is raised before any state changes.
"""

from __future__ import annotations

import errno
from concurrent.futures import CancelledError, Future


class ServiceError(Exception):
    """Base class: ``status`` is the HTTP status, ``code`` a stable machine-readable name."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, **details: object) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details

    def body(self) -> dict:
        """The JSON error body (Cortex shape: ``message`` and ``code``; plus any details)."""
        return {"message": self.message, "code": self.code, **self.details}


def internal_error(request_id: str) -> ServiceError:
    """What a caller is told of an exception nobody anticipated: a 500 naming the request, whose
    traceback the server logged under that id (the exception's own text stays in the log: it
    may hold paths and internals)."""
    return ServiceError(
        f"internal error in request {request_id}; the server's log has its traceback",
        request_id=request_id,
    )


class BadRequest(ServiceError):
    """Malformed body, unknown field, bad value (400)."""

    status = 400
    code = "invalid_argument"


class Unauthorized(ServiceError):
    """Missing or wrong credentials (401)."""

    status = 401
    code = "unauthenticated"


class NotFound(ServiceError):
    """Unknown job, sub-job, request or checkpoint, or one owned by another token (404)."""

    status = 404
    code = "not_found"


class Conflict(ServiceError):
    """The request clashes with the job's state or an earlier request (409)."""

    status = 409
    code = "conflict"


def failure_of(future: Future) -> BaseException | None:
    """The exception a finished op's ``future`` ended with, or None. An op still queued when its
    job ended (cancelled, expired idle, or the server closing) has its future cancelled; that is
    the 409 ``job_cancelled`` every surface answers for it, never a ``CancelledError`` (which
    escapes the handlers of ``Exception`` as an internal error, or leaves a Tinker future
    unfinished for ever)."""
    if future.cancelled():
        return Conflict("the op did not run: its job ended first", code="job_cancelled")
    return future.exception()


def result_of(future: Future):
    """Wait for ``future`` and return its result, raising what :func:`failure_of` says."""
    try:
        return future.result()
    except CancelledError:
        raise failure_of(future) from None


class RequestTimeout(ServiceError):
    """The request body did not arrive within the server's read deadline (408)."""

    status = 408
    code = "request_timeout"


class PayloadTooLarge(ServiceError):
    """Body above the server's limit (413)."""

    status = 413
    code = "payload_too_large"


class TooManyRequests(ServiceError):
    """A per-tenant concurrency limit is full; the same request can succeed later (429)."""

    status = 429
    code = "too_many_requests"


class ClientDisconnected(ServiceError):
    """The client closed the connection before its request body arrived. Nothing reaches it;
    499 (nginx's "client closed request") is what the access log records."""

    status = 499
    code = "client_disconnected"


class EngineFailure(ServiceError):
    """An engine raised while running an op; the job is marked failed (500)."""

    status = 500
    code = "engine_failure"


class InsufficientStorage(ServiceError):
    """The server's disk (or the tenant's quota) is full (507); the job is unchanged."""

    status = 507
    code = "insufficient_storage"


class StorageFailure(ServiceError):
    """A filesystem error while writing a checkpoint (500); the job is unchanged."""

    status = 500
    code = "storage_error"


# Filesystem errors a request's own choice causes (its path names something that is not a
# folder, or a name the filesystem refuses), and those of a full disk.
_REQUEST_ERRNOS = {errno.ENAMETOOLONG, errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EINVAL}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def checkpoint_write_failure(op: str, code: int | None, message: str) -> ServiceError:
    """The error answering a save that the filesystem refused (errno ``code``): the request's
    fault (400 naming ``path``), a full disk (507) or else the server's (500), never the job's."""
    if code in _REQUEST_ERRNOS:
        return BadRequest(f"{op}: {message}", field="path")
    if code in _FULL_ERRNOS:
        return InsufficientStorage(f"{op}: {message}")
    return StorageFailure(f"{op}: {message}")
