"""Asynchronous requests and request chunk groups of the Cortex-compatible API.

The Cortex data plane is submit-then-poll: a call returns a ``request_id`` at once, the op runs on
its job's queue, and ``GET requests/{rid}`` reports progress and the result. Results too large to
inline are delivered as ``result_chunk`` events the client drains with a cursor; streaming
generation delivers its outputs as events too.

Large request bodies arrive as DSSST1 chunk groups. :class:`ChunkGroups` reassembles them and
guarantees **at-most-once execution** per ``chunk_group_id`` and frame hash: a retried final chunk
gets the original ``request_id`` back instead of running the op again, which is what makes a
retried ``forward-backward`` safe (gradients are applied once). The chunks of incomplete groups
are held in memory, so what one tenant may hold there is capped (``--max-chunk-group-mb``).
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from arctic_platform import wire
from arctic_platform.contract.ops import OpName
from arctic_platform.contract.states import RequestState
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.server.errors import BadRequest, Conflict, ServiceError
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.pending_work import payload_nbytes
from arctic_platform.server.request_registry import (
    RequestRegistry,
    TrackedRequest,
    outcome,
)

INLINE_RESULT_BYTES = 8 * 1024 * 1024
RESULT_CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_EVENTS = 16
MAX_EVENTS = 512
# Finished requests kept for polling (the one that finished first is dropped past this).
MAX_FINISHED = 4096


@dataclass(kw_only=True)
class AsyncRequest(TrackedRequest):
    """One submitted op and what became of it."""

    job_id: str
    sub_job_id: str
    op: str
    binary_result: bool
    status: RequestState = "pending"
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    result: Any = None
    error: str | None = None
    # The failure as the other surfaces report it: the HTTP status they would answer, with the
    # error body (``message``, ``code``, details); ``error`` keeps the reference's string.
    error_detail: dict | None = None
    events: list[dict] = field(default_factory=list)
    stream_cursor: int = 0
    reshape: Callable[[Any], Any] | None = field(default=None, repr=False)
    # Stops this request's op in flight (``cancel-request``); see engine/cancellation.py.
    stop: CancelToken = field(default_factory=CancelToken, repr=False)

    @property
    def streaming(self) -> bool:
        """Streaming generation: its outputs are events, drained by a server-side cursor."""
        return self.op == OpName.GENERATE_STREAM


# What an incomplete chunk group holds beyond its chunks' bytes (its record, digests and event:
# about 3.3 KB measured), counted with them toward --max-chunk-group-mb: counted by its chunks
# alone, a tenant's groups of one small chunk each held eight times what they counted.
GROUP_BYTES = 4096

# What a finished request's future becomes once its outcome is recorded: done, holding nothing.
_SETTLED: Future = Future()
_SETTLED.set_result(None)


def _stored_nbytes(request: AsyncRequest) -> int:
    """The bytes a finished request keeps: its recorded result and events."""
    return payload_nbytes(request.result) + payload_nbytes(request.events)


class RequestStore:
    """Cortex requests by id, in the server's request registry (each visible in its job; past
    ``max_finished`` finished ones, or ``max_finished_bytes`` of their results, the first
    finished of the job holding the most is forgotten), with what became of each."""

    def __init__(
        self, max_finished: int = MAX_FINISHED, max_finished_bytes: int | None = None
    ) -> None:
        # Guards the records' outcome fields; the registry guards which requests exist.
        self._lock = threading.Lock()
        self._requests: RequestRegistry[AsyncRequest] = RequestRegistry(
            max_finished, max_finished_bytes, size=_stored_nbytes
        )

    def track(
        self,
        submit: Callable[[CancelToken], Future],
        *,
        job_id: str,
        sub_job_id: str,
        op: str,
        binary_result: bool,
        reshape: Callable[[Any], Any] | None = None,
    ) -> AsyncRequest:
        """Start an op with ``submit(stop)`` (``stop``: the token that cancels it in flight) and
        return its request; its outcome is recorded when it resolves (passed through ``reshape``
        first, when given: the result form the client asked for)."""
        stop = CancelToken()
        future = submit(stop)
        request = AsyncRequest(
            future=future,
            job_id=job_id,
            sub_job_id=sub_job_id,
            op=op,
            binary_result=binary_result,
            reshape=reshape,
            stop=stop,
        )
        # The registry counts it finished once its outcome is recorded: it measures what is kept.
        recorded: Future = Future()
        self._requests.add(request, scope=job_id, settled=recorded)
        future.add_done_callback(lambda f: self._finish(request, f, recorded))
        return request

    def get(self, job_id: str, request_id: str) -> AsyncRequest:
        return self._requests.get(request_id, scope=job_id)

    def cancel(self, job_id: str, request_id: str) -> dict:
        """Cancel a request: a queued one never runs; a running one stops at its next decode
        step or microbatch (the points where stopping leaves the engine as it was before the
        op: a stopped ``forward-backward`` adds no gradient), and its poll then says
        ``cancelled``. An op without such points (``step``, ``save``, a weight sync) finishes.
        ``cancelled`` is false only for a request that had already ended."""
        request = self.get(job_id, request_id)
        cancelled = request.future.cancel()
        if not cancelled and not request.future.done():
            request.stop.cancel(f"request {request_id} was cancelled")
            cancelled = True
        return {"request_id": request_id, "cancelled": cancelled, "status": request.status}

    def poll(self, job_id: str, request_id: str, *, cursor: str | None, max_events: int | None):
        """The poll response: status, inline result or result-chunk events, next cursor."""
        request = self.get(job_id, request_id)
        limit = DEFAULT_MAX_EVENTS if max_events is None else max_events
        if not 1 <= limit <= MAX_EVENTS:
            raise BadRequest(f"max_events must be in 1..{MAX_EVENTS}, got {limit}")
        with self._lock:
            streaming = request.streaming
            # Streaming events are drained destructively by the server-side cursor; result
            # chunks by the client's cursor, so a lost poll response can be re-read.
            start = request.stream_cursor if streaming else _cursor(cursor, len(request.events))
            events = request.events[start : start + limit]
            end = start + len(events)
            if streaming:
                request.stream_cursor = end
            more = end < len(request.events)
            status = request.status
            if status == "pending" and request.future.running():
                status = "running"
            body = {
                "request_id": request.request_id,
                "job_id": request.job_id,
                "status": status,
                "created_at": request.created_at,
                "updated_at": request.updated_at,
                "result": request.result,
                "error": request.error,
                "error_detail": request.error_detail,
                "events": events,
                "next_cursor": str(end) if more and not streaming else "",
            }
        return body

    def _finish(self, request: AsyncRequest, future: Future, recorded: Future) -> None:
        try:
            self._record(request, future)
        finally:  # the registry counts it finished (and measures it) from now on
            recorded.set_result(None)

    def _record(self, request: AsyncRequest, future: Future) -> None:
        # Shaping and encoding happen outside the lock: a big result takes a while, and polls
        # of other requests must not wait for it.
        status, result, events, error = "done", None, [], None
        if future.cancelled():
            status = "cancelled"
        else:
            try:
                result, events = outcome(request.request_id, lambda: self._outcome(request, future))
            except ServiceError as exc:
                stopped = exc.code == "op_cancelled"
                status = "cancelled" if stopped and request.stop.cancelled else "failed"
                error = exc
        with self._lock:
            request.updated_at = time.time()
            request.status = status
            request.result, request.events = result, events
            if error is not None:
                request.error = error.message
                request.error_detail = {"status": error.status, **error.body()}
            # The op's raw result now lives on in its recorded form only.
            request.future = _SETTLED

    @staticmethod
    def _outcome(request: AsyncRequest, future: Future) -> tuple[Any, list[dict]]:
        """``(result, events)`` of a resolved request; raises the op's error."""
        value = future.result()
        if request.reshape is not None:
            value = request.reshape(value)
        if request.streaming:
            events = [{"type": "result", "index": i, "output": o} for i, o in enumerate(value)]
            events.append({"type": "done", "count": len(value)})
            return {"count": len(value)}, events
        if request.binary_result:
            return _encode_result(value)
        return value, []


def _cursor(cursor: str | None, size: int) -> int:
    if cursor in (None, ""):
        return 0
    try:
        value = int(cursor)
    except ValueError:
        raise BadRequest(f"cursor {cursor!r} is not a cursor this server issued") from None
    if not 0 <= value <= size:
        raise BadRequest(f"cursor {cursor!r} is out of range")
    return value


def _encode_result(value: Any) -> tuple[dict | None, list[dict]]:
    """Small results inline as base64 DSSST1; large ones as ``result_chunk`` events."""
    frame = wire.dumps(value)
    if len(frame) <= INLINE_RESULT_BYTES:
        inline = {
            "content_type": "application/octet-stream",
            "encoding": "base64",
            "wire_format": wire.WIRE_FORMAT_VERSION,
            "payload_b64": base64.b64encode(frame).decode("ascii"),
        }
        return inline, []
    events = []
    for chunk in wire.encode_byte_chunks(frame, kind="result", max_bytes=RESULT_CHUNK_BYTES):
        events.append(
            {
                "type": "result_chunk",
                "payload_b64": base64.b64encode(chunk).decode("ascii"),
                "payload_sha256": hashlib.sha256(chunk).hexdigest(),
            }
        )
    return None, events


# ----------------------------------------------------------------------------------------------
# request chunk groups
# ----------------------------------------------------------------------------------------------


@dataclass
class _Group:
    descriptor: dict
    owner: str | None
    chunk_digests: dict[int, str] = field(default_factory=dict)
    chunks: dict[int, bytes] = field(default_factory=dict)
    held: int = 0  # bytes of ``chunks`` and GROUP_BYTES, counted in the per-owner total
    request_id: str | None = None
    scheduled: bool = False
    # Its frame was refused for now (429): only a resend of its last chunk submits it again.
    deferred: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    touched: float = field(default_factory=time.time)

    @property
    def total(self) -> int:
        return self.descriptor["total_chunks"]

    @property
    def complete(self) -> bool:
        return len(self.chunk_digests) == self.total

    def missing(self) -> list[int]:
        return [i for i in range(self.total) if i not in self.chunk_digests]


@dataclass
class ChunkOutcome:
    """What one posted chunk led to: keep waiting, run the whole frame, or a known request."""

    frame: bytes | None = None
    group_id: str | None = None
    request_id: str | None = None
    received: int = 0
    total: int = 0


_GROUP_KEYS = ("total_chunks", "frame_sha256", "frame_size_bytes", "operation")
# A group's chunk count is bounded so that bookkeeping per chunk stays small (the client sends
# chunks of up to 60 MiB: this allows frames far beyond any body limit).
MAX_CHUNKS_PER_GROUP = 4096
MAX_GROUP_ID_CHARS = 128
# Seconds an incomplete group is kept without a new chunk, and a completed group's request id.
STALE_S = 600.0
RETENTION_S = 3600.0


def check_descriptor(meta: dict) -> tuple[str, int]:
    """``(chunk_group_id, chunk_idx)`` of a request-chunk descriptor whose every field has the
    right type and range; else a 400 naming the field."""

    def bad(field: str, expected: str) -> BadRequest:
        return BadRequest(
            f"request chunk: {field} must be {expected}, got {_short(meta.get(field))}",
            field=field,
        )

    group_id = meta.get("chunk_group_id")
    if not isinstance(group_id, str) or not 1 <= len(group_id) <= MAX_GROUP_ID_CHARS:
        raise bad("chunk_group_id", f"a string of 1..{MAX_GROUP_ID_CHARS} characters")
    total = meta.get("total_chunks")
    if not _is_int(total) or not 1 <= total <= MAX_CHUNKS_PER_GROUP:
        raise bad("total_chunks", f"an integer in 1..{MAX_CHUNKS_PER_GROUP}")
    index = meta.get("chunk_idx")
    if not _is_int(index) or not 0 <= index < total:
        raise bad("chunk_idx", f"an integer in 0..{total - 1}")
    size = meta.get("frame_size_bytes")
    if not _is_int(size) or size < 0:
        raise bad("frame_size_bytes", "a non-negative integer")
    digest = meta.get("frame_sha256")
    if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef"):
        raise bad("frame_sha256", "64 lowercase hex digits")
    if meta.get("operation") is not None and not isinstance(meta["operation"], str):
        raise bad("operation", "a string")
    return group_id, index


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ChunkGroups:
    """Reassembles request chunk groups per sub-job, executing each group at most once.

    Completed groups keep only their chunk digests and ``request_id`` (no payload), for
    ``retention_s``; incomplete groups are dropped after ``stale_s`` without new chunks (by
    :meth:`expire_stale`, which the Service also runs on a timer, so an abandoned group's bytes
    are freed even when no other chunk arrives). The bytes an owner's incomplete groups hold are
    bounded by ``limits.max_chunk_group_mb``.
    """

    def __init__(
        self,
        *,
        limits: ServerLimits | None = None,
        retention_s: float = RETENTION_S,
        stale_s: float = STALE_S,
    ) -> None:
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str], _Group] = {}
        self._held: Counter = Counter()  # owner -> bytes in its incomplete groups
        self._limits = limits or ServerLimits()
        self._retention_s = retention_s
        self.stale_s = stale_s

    def held_bytes(self, owner: str | None) -> int:
        """Bytes ``owner``'s incomplete groups hold."""
        with self._lock:
            return self._held[owner]

    def receive(self, sub_job_id: str, frame: bytes, *, owner: str | None) -> ChunkOutcome:
        """Take one posted body of ``owner``. A body that is not a chunk passes through as a
        whole frame; a chunk beyond the owner's byte cap is refused (413 ``limit_exceeded``)
        and changes nothing."""
        meta = wire.read_byte_chunk_metadata(frame)
        if meta is None:
            return ChunkOutcome(frame=frame)
        if meta.get("kind") != "request":
            raise BadRequest("expected a request chunk, got a result chunk")
        try:
            payload = wire.loads(frame)["payload"]
        except (wire.WireError, KeyError, TypeError) as exc:
            raise BadRequest(f"malformed request chunk: {exc}") from None
        if not (
            isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and payload.ndim == 1
        ):
            raise BadRequest(
                "malformed request chunk: payload must be a 1-D uint8 tensor (the frame's bytes), "
                f"got {type(payload).__name__}",
                field="payload",
            )
        group_id, index = check_descriptor(meta)
        digest = hashlib.sha256(payload).hexdigest()
        key = (sub_job_id, group_id)
        with self._lock:
            self._expire(time.time() - self.stale_s)
            group = self._groups.get(key)
            if group is None:
                if index != 0:
                    raise Conflict(
                        f"chunk group {group_id!r} is unknown here; restart it from chunk 0",
                        code="chunk_group_restart_required",
                        chunk_group_id=group_id,
                    )
                # A frame that can never fit is refused before any of it is held.
                self._limits.check_chunk_bytes(meta["frame_size_bytes"], alone=True)
                self._limits.check_chunk_bytes(self._held[owner] + GROUP_BYTES + len(frame))
                group = _Group(
                    descriptor={k: meta.get(k) for k in _GROUP_KEYS}, owner=owner, held=GROUP_BYTES
                )
                self._groups[key] = group
                self._held[owner] += GROUP_BYTES
            self._check_same_group(group, meta, group_id)
            known = group.chunk_digests.get(index)
            if known is not None and known != digest:
                raise Conflict(
                    f"chunk {index} of group {group_id!r} was already received with other bytes",
                    code="chunk_group_conflict",
                    chunk_group_id=group_id,
                )
            group.touched = time.time()
            if group.scheduled:
                # A retry of a group that already ran (or is being scheduled): same request.
                return self._existing(group, group_id)
            added = len(frame) - len(group.chunks.get(index, b""))
            try:  # the group alone, its chunks' headers included: it can never fit, so it goes
                self._limits.check_chunk_bytes(group.held + added, alone=True)
            except ServiceError:
                del self._groups[key]
                self._release(group)
                group.ready.set()
                raise
            self._limits.check_chunk_bytes(self._held[group.owner] + added)  # beside the others
            group.chunk_digests[index] = digest
            group.chunks[index] = frame
            group.held += added
            self._held[group.owner] += added
            last = index == group.total - 1
            if not group.complete or (group.deferred and not last):
                if last:
                    missing = group.missing()
                    raise Conflict(
                        f"request chunk group is missing chunks {missing[:20]}",
                        code="chunk_group_missing_chunks",
                        chunk_group_id=group_id,
                        missing_chunks=missing[:1000],
                    )
                return ChunkOutcome(
                    group_id=group_id, received=len(group.chunks), total=group.total
                )
            group.scheduled, group.deferred = True, False
            chunks = [group.chunks[i] for i in range(group.total)]
        try:
            whole = wire.decode_byte_chunks(chunks, kind="request")
        except wire.WireError as exc:
            self.forget(sub_job_id, group_id)
            raise BadRequest(f"chunk group {group_id!r} does not reassemble: {exc}") from None
        return ChunkOutcome(frame=whole, group_id=group_id, received=len(chunks), total=len(chunks))

    def completed(self, sub_job_id: str, group_id: str, request_id: str) -> None:
        """Record that the group's frame was scheduled as ``request_id``; drop its payload."""
        with self._lock:
            group = self._groups.get((sub_job_id, group_id))
            if group is not None:
                group.request_id = request_id
                self._release(group)
                group.ready.set()

    def unschedule(self, sub_job_id: str, group_id: str) -> None:
        """The group's frame was refused for now (429: the owner's unfinished ops are full): it
        keeps its chunks, unscheduled, and the client's resend of its last chunk submits it
        again (a resend of another chunk, as a client restarting the group sends first, is
        only acknowledged: a client expects the request id from the last chunk). Retries
        waiting on it meanwhile are told to restart the group."""
        with self._lock:
            group = self._groups.get((sub_job_id, group_id))
            if group is None:
                return
            group.scheduled, group.deferred = False, True
            waiting, group.ready = group.ready, threading.Event()
        waiting.set()

    def forget(self, sub_job_id: str, group_id: str) -> None:
        """Drop a group whose frame was rejected, so a corrected retry can start over."""
        with self._lock:
            group = self._groups.pop((sub_job_id, group_id), None)
            if group is not None:
                self._release(group)
        if group is not None:
            group.ready.set()

    def _existing(self, group: _Group, group_id: str) -> ChunkOutcome:
        """Outcome for a chunk of an already scheduled group (called with the lock held)."""
        if group.request_id is None:
            self._lock.release()
            try:
                group.ready.wait(timeout=60.0)
            finally:
                self._lock.acquire()
        if group.request_id is None:
            raise Conflict(
                f"chunk group {group_id!r} was not executed; restart it from chunk 0",
                code="chunk_group_restart_required",
                chunk_group_id=group_id,
            )
        return ChunkOutcome(
            group_id=group_id, request_id=group.request_id, received=group.total, total=group.total
        )

    @staticmethod
    def _check_same_group(group: _Group, meta: dict, group_id: str) -> None:
        for key in _GROUP_KEYS:
            if meta.get(key) != group.descriptor.get(key):
                raise Conflict(
                    f"chunk group {group_id!r} was started with a different {key}",
                    code="chunk_group_conflict",
                    chunk_group_id=group_id,
                )

    def expire_stale(self, cutoff: float) -> list[str]:
        """Drop the incomplete groups without a chunk since ``cutoff`` (``time.time()``), and
        completed ones past their retention; their chunk group ids."""
        with self._lock:
            return self._expire(cutoff)

    def _expire(self, cutoff: float) -> list[str]:
        """:meth:`expire_stale` with the lock held."""
        retained = cutoff + self.stale_s - self._retention_s  # completed groups' cutoff
        dropped = []
        for key, group in list(self._groups.items()):
            if group.touched < (retained if group.request_id is not None else cutoff):
                del self._groups[key]
                self._release(group)
                group.ready.set()  # a retry waiting on it gets a definite answer
                dropped.append(key[1])
        return dropped

    def _release(self, group: _Group) -> None:
        """Free a group's chunks and count them off its owner's total (lock held)."""
        group.chunks.clear()
        self._held[group.owner] -= group.held
        if not self._held[group.owner]:
            del self._held[group.owner]
        group.held = 0
