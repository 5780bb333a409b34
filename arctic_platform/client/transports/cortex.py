"""The ``cortex`` backend: any server speaking the Cortex/SnowAPI job API (ours included).

Facts of the API: reference/client_wire_api.md §2. How this transport uses it:

* **Job ops** (``contract/job_ops.py``). ``create-job`` is ``POST {prefix}`` with
  ``{"sub_job_configs": [...]}`` (one job holding every sub-job), then ``GET {prefix}/{job}`` for
  its sub-job ids; ``get-job`` is ``GET {prefix}/{job}`` (``?wait_s=``: our server holds the
  answer while the job starts); ``cancel-job`` is ``POST {prefix}/{job}:cancel``.
* **Data plane.** Every op posts to ``{prefix}/{job}/{route}`` (the job of the request's sub-job
  id) and gets ``{"request_id"}``; the
  transport polls ``GET .../requests/{rid}`` with the same backoff until the request is done
  (bounded by ``poll_timeout``), collecting ``result_chunk`` events through ``next_cursor`` and
  checking their sha256, then decodes the DSSST1 result (inline base64 or chunks) or the JSON one.
  ``forward`` uses our ``forward-no-grad`` route; sleep/wake/cache ops and weight sync travel as
  ``/operation`` envelopes, answered inline or with a ``request_id``.
* **Chunking and exactly-once gradients.** Octet bodies above ``max_request_bytes`` travel as a
  request chunk group. ``forward-backward`` is *always* sent as a group (``force_chunk``), so every
  call has a ``chunk_group_id``: re-posting a chunk whose response was lost returns the original
  ``request_id`` instead of running the step again. Chunk-group errors are never retried per chunk;
  on ``chunk_group_restart_required`` the whole group is replayed once from chunk 0 with the same
  group id.
* **Retries** (tenacity, exponential backoff with jitter from ``retry_initial_wait`` (0.5 s) up to
  ``retry_max_wait`` (10 s), at most ``max_retries``): connection
  errors and 404/409/429/5xx are retried for requests that are safe to repeat (polls, job status,
  chunk posts, side-effect-free submissions). ``step``, ``save``, ``load`` and operations carry no
  idempotency key in the API, so only failures to connect and 429 are retried for them; any other
  failure is raised rather than risking a second optimizer step. 409/5xx answers whose code says
  the job ended (``job_failed``, ``engine_failure``, ...) are final.
* **Auth.** The PAT headers (``Authorization: Bearer``, ``X-Snowflake-Authorization-Token-Type:
  PROGRAMMATIC_ACCESS_TOKEN``) are sent when the token variable is set, and required unless
  ``base_url`` is a plain-HTTP loopback URL (see ``CortexBackend``).
* **Errors.** A failed request's error is ``"<Kind>: <message>"`` on our server; the kind maps to
  the same exception class the other backends raise for it (``BadRequest`` ->
  :class:`InvalidRequestError`, ...); any other failure is a :class:`ServerError` with code
  ``request_failed``.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt

from arctic_platform import wire
from arctic_platform.client.config import ArcticRLClientConfig, CortexBackend
from arctic_platform.client.errors import (
    ArcticRLError,
    ChunkGroupError,
    InvalidRequestError,
    NotFoundError,
    RequestTimeoutError,
    ServerError,
    bad_response,
    server_error,
)
from arctic_platform.client.tensors import resolve_tensor_type
from arctic_platform.client.transport import Request, Transport
from arctic_platform.client.transports.http_common import (
    answer_field,
    connection_error,
    decode_body,
    error_from_fields,
    error_from_response,
    log_failed,
    octet_request,
    read_job_status,
    retry_wait,
)
from arctic_platform.client.transports.liveness import LivenessWatch
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.job_ops import JOB_OPS, JobStatus
from arctic_platform.contract.ops import OPERATION, OpName, Retry
from arctic_platform.contract.ops import op as contract_op
from arctic_platform.contract.states import TERMINAL_JOB_STATES, cortex_name

log = logging.getLogger(__name__)

PAT_TYPE_HEADER = "X-Snowflake-Authorization-Token-Type"
PAT_TYPE = "PROGRAMMATIC_ACCESS_TOKEN"
RESPONSE_OPTIONS = {"response_options": {"format": "dssst1", "delivery": "chunked"}}
RETRY_STATUSES = frozenset({404, 409, 429, 500, 502, 503, 504})
FINAL_CODES = frozenset(
    {
        "job_failed",
        "job_cancelled",
        "job_terminated",
        "failed_precondition",
        "engine_failure",
        "invalid_argument",
    }
)
MAX_EVENTS = 512
# Our states (contract/states.py) and the other spellings Cortex servers use for them.
DONE = {"done", "completed", "succeeded"}
FAILED = {"failed"}
CANCELLED = {"cancelled", "canceled"}


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures of one HTTP request may be retried."""

    statuses: frozenset[int]
    after_send: bool  # retry connection failures that happen after the request was sent


REPEATABLE = RetryPolicy(RETRY_STATUSES, after_send=True)
NOT_REPEATABLE = RetryPolicy(frozenset({429}), after_send=False)
# A poll's 404 is first checked against the job: a job that ended took its requests with it.
POLL = RetryPolicy(RETRY_STATUSES - {404}, after_send=True)


class CortexTransport(Transport):
    """One Cortex job with its sub-jobs (see module doc)."""

    def __init__(
        self, config: ArcticRLClientConfig, *, http_transport: httpx.BaseTransport | None = None
    ) -> None:
        backend = config.backend
        assert isinstance(backend, CortexBackend)
        self.config = config
        self.backend = backend
        self._tensor_type = resolve_tensor_type(config.tensor_type)
        headers = {}
        token = backend.resolve_pat()
        if token is not None:
            headers = {"Authorization": f"Bearer {token}", PAT_TYPE_HEADER: PAT_TYPE}
        self._client: httpx.Client | None = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(backend.request_timeout, connect=10.0),
            verify=backend.verify_tls,
            transport=http_transport,
        )
        self._watch: LivenessWatch | None = None
        if backend.liveness_timeout is not None:
            self._watch = LivenessWatch(
                backend.prefix,
                headers,
                backend.liveness_timeout,
                probe="/capacity",
                verify=backend.verify_tls,
            )

    def _job_url(self, job_id: str) -> str:
        return f"{self.backend.prefix}/{parent_of(job_id)}"

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    # -- ops --------------------------------------------------------------------------------

    def call(self, request: Request) -> Any:
        return self._watched(lambda: self._call(request), op=request.op)

    def _watched(self, call, *, op: str) -> Any:
        """``call()``, failing with :class:`ServerUnresponsiveError` once the server stays silent
        for ``liveness_timeout`` (see :mod:`arctic_platform.client.transports.liveness`)."""
        if self._watch is None:
            return call()
        return self._watch.run(call, op=op)

    def _call(self, request: Request) -> Any:
        op = request.op
        if op in JOB_OPS:
            return self._job_op(request)
        if op == OPERATION:
            return self._operation(request.job_id, request.body)
        spec = contract_op(op)
        if op == OpName.LOAD_CHECKPOINT:
            return self._load(request)
        if spec.cortex_route is None:
            # No route of its own: an operation envelope addressed to the sub-job.
            payload = request.body
            if op == OpName.WAKE_INFERENCE:
                payload = {} if payload is None else {"tags": payload}
            envelope = {
                "operation_type": op,
                "sub_job_id": request.job_id,
                "payload": payload or {},
            }
            return self._operation(request.job_id, envelope)
        if spec.binary_request:
            force_chunk = spec.retry == "chunk_group"
            return self._octet(request, spec.cortex_route, force_chunk=force_chunk)
        policy = _policy(spec.retry)
        return self._submit_json(request.job_id, op, spec.cortex_route, request.body, policy)

    def _job_op(self, request: Request) -> Any:
        """A job op on the Cortex routes, answered as the contract's result model."""
        op = request.op
        spec = JOB_OPS[op]
        route, policy = spec.cortex, _policy(spec.retry)
        if op == OpName.CREATE_JOB:
            url = self.backend.prefix + route.path
            answer = self._request(route.method, url, op=op, policy=policy, json=request.body)
            job_id = str(answer_field(answer, "job_id", op))
            try:
                return self._job_status(job_id).created().model_dump(mode="json")
            except BaseException:
                try:
                    self._job_op(Request(OpName.CANCEL_JOB, job_id))
                except ArcticRLError as exc:  # the error worth raising is the first one
                    log.warning("could not cancel job %s: %s", job_id, exc)
                raise
        if op == OpName.GET_JOB:  # a GET: its body travels as query parameters
            return self._job_status(request.job_id, request.body).model_dump(mode="json")
        url = self.backend.prefix + route.path.format(job_id=parent_of(request.job_id))
        self._request(route.method, url, op=op, policy=policy)
        return None

    def _job_status(self, job_id: str, params: dict | None = None) -> JobStatus:
        route = JOB_OPS[OpName.GET_JOB].cortex
        url = self.backend.prefix + route.path.format(job_id=parent_of(job_id))
        policy = _policy(JOB_OPS[OpName.GET_JOB].retry)
        info = self._request(route.method, url, op=OpName.GET_JOB, policy=policy, params=params)
        return read_job_status(JobStatus.from_info, info)

    def _octet(self, request: Request, route: str, *, force_chunk: bool) -> Any:
        op = request.op
        url = f"{self._job_url(request.job_id)}/{route}"
        metadata = _merge_options(RESPONSE_OPTIONS, request.frame_metadata)
        buffers = wire.dumps_buffers(request.body, metadata=metadata)
        size = sum(memoryview(b).nbytes for b in buffers)
        limit = self.backend.max_request_bytes
        if not force_chunk and size <= limit:
            content, headers = octet_request(buffers)
            answer = self._request(
                "POST", url, op=op, policy=REPEATABLE, content=content, headers=headers
            )
            return self._poll(request.job_id, str(answer_field(answer, "request_id", op)), op)
        chunks = wire.encode_byte_chunks(
            b"".join(buffers), kind="request", operation=op, max_bytes=limit, force_chunk=True
        )
        return self._poll(request.job_id, self._send_group(url, chunks, op), op)

    def _send_group(self, url: str, chunks: list[bytes], op: str) -> str:
        """Post a chunk group; replay it once from chunk 0 if the server asks (module doc)."""
        try:
            return self._post_group(url, chunks, op)
        except ChunkGroupError as exc:
            if exc.code != "chunk_group_restart_required":
                raise
            log.warning("%s: the server asks to restart the chunk group; replaying it once", op)
        return self._post_group(url, chunks, op)

    def _post_group(self, url: str, chunks: list[bytes], op: str) -> str:
        request_id = None
        for index, chunk in enumerate(chunks):
            content, headers = octet_request([chunk])
            answer = self._request(
                "POST", url, op=op, policy=REPEATABLE, content=content, headers=headers
            )
            request_id = answer.get("request_id") if isinstance(answer, dict) else None
            if request_id is not None and index != len(chunks) - 1:
                raise bad_response(f"request_id returned for chunk {index} of {len(chunks)}", op=op)
        if request_id is None:
            raise bad_response("no request_id after the final chunk", op=op)
        return str(request_id)

    def _submit_json(self, job_id: str, op: str, route: str, body: Any, policy: RetryPolicy) -> Any:
        url = f"{self._job_url(job_id)}/{route}"
        answer = self._request("POST", url, op=op, policy=policy, json=body)
        return self._poll(job_id, str(answer_field(answer, "request_id", op)), op)

    def _operation(self, job_id: str, envelope: dict) -> Any:
        op = str(envelope.get("operation_type", "operation"))
        url = f"{self._job_url(job_id)}/{OPERATION}"
        answer = self._request("POST", url, op=op, policy=NOT_REPEATABLE, json=envelope)
        if (
            isinstance(answer, dict)
            and set(answer) <= {"request_id", "job_id"}
            and "request_id" in answer
        ):
            return self._poll(job_id, str(answer["request_id"]), op)
        return answer

    def _load(self, request: Request) -> Any:
        op = request.op
        body = dict(request.body)
        if "path" in body:
            raise InvalidRequestError(
                "path: the cortex API loads checkpoints by checkpoint_id (or step), not by a "
                "server-side folder; pass checkpoint_id= (save_checkpoint returns it) or step=",
                status=None,
                code="invalid_argument",
                op=op,
            )
        if "checkpoint_id" not in body:
            step = body.pop("step", None)
            url = f"{self._job_url(request.job_id)}/checkpoints"
            listing = self._request("GET", url, op=op, policy=REPEATABLE)
            found = [
                c
                for c in answer_field(listing, "checkpoints", op)
                if step is None or c.get("global_steps") == step
            ]
            if not found:
                which = "" if step is None else f" at step {step}"
                raise NotFoundError(
                    f"job {parent_of(request.job_id)} has no checkpoint{which}",
                    status=404,
                    code="not_found",
                    op=op,
                )
            latest = max(
                found, key=lambda c: (c.get("global_steps") or 0, c.get("created_at") or 0)
            )
            body["checkpoint_id"] = latest["checkpoint_id"]
        body.setdefault("target_sub_job_id", request.job_id)
        route = contract_op(op).cortex_route
        return self._submit_json(request.job_id, op, route, body, NOT_REPEATABLE)

    # -- polling ----------------------------------------------------------------------------

    def _poll(self, job_id: str, request_id: str, op: str) -> Any:
        backend = self.backend
        url = f"{self._job_url(job_id)}/requests/{request_id}"
        deadline = time.monotonic() + backend.poll_timeout
        interval = backend.poll_interval
        cursor: str | None = None
        chunks: list[bytearray] = []
        while True:
            params: dict[str, Any] = {"max_events": MAX_EVENTS}
            if cursor:
                params["cursor"] = cursor
            try:
                state = self._request("GET", url, op=op, policy=POLL, params=params)
            except NotFoundError:
                self._raise_if_job_ended(job_id, request_id, op)
                state = self._request("GET", url, op=op, policy=REPEATABLE, params=params)
            for event in state.get("events") or []:
                if isinstance(event, dict) and event.get("type") == "result_chunk":
                    chunks.append(_chunk_payload(event, op))
            cursor = state.get("next_cursor") or None
            if cursor:
                continue  # more events are waiting: fetch them now
            status = cortex_name(state.get("status"), "request_state_")
            if status in DONE:
                return self._result(state, chunks, op)
            if status in FAILED:
                raise _failed_request(state, op)
            if status in CANCELLED:
                raise server_error(
                    409, "request_cancelled", f"request {request_id} was cancelled", op=op
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"{op}: request {request_id} is still {status} after "
                    f"{backend.poll_timeout:.0f}s"
                )
            time.sleep(min(interval, remaining))
            interval = min(interval * backend.poll_backoff, backend.poll_max_interval)

    def _raise_if_job_ended(self, job_id: str, request_id: str, op: str) -> None:
        """A request the server does not know, in a job that ended (a server restart ends every
        job it ran): say so at once instead of retrying the poll."""
        status = self._job_status(job_id)
        if status.status in TERMINAL_JOB_STATES:
            raise server_error(
                409,
                f"job_{status.status}",
                f"job {status.job_id} ended ({status.status}: {status.reason}) and request "
                f"{request_id} ended with it; the op's outcome is unknown",
                op=op,
            )

    def _result(self, state: dict, chunks: list[bytearray], op: str) -> Any:
        if chunks:
            try:
                return wire.decode_result_chunks(chunks, tensor_type=self._tensor_type)
            except wire.WireError as exc:
                raise bad_response(f"malformed result chunks: {exc}", op=op) from None
        result = state.get("result")
        if isinstance(result, dict) and result.get("wire_format") == wire.WIRE_FORMAT_VERSION:
            payload = bytearray(base64.b64decode(answer_field(result, "payload_b64", op)))
            return decode_body(payload, "application/octet-stream", self._tensor_type, op=op)
        return {} if result is None else result

    # -- HTTP -------------------------------------------------------------------------------

    def _request(self, method: str, url: str, *, op: str, policy: RetryPolicy, **kwargs) -> Any:
        """One HTTP exchange with the policy's retries; decoded JSON, or the client's errors."""
        if self._client is None:
            raise ArcticRLError(f"{op}: the transport was shut down")
        client = self._client

        def retryable(exc: BaseException) -> bool:
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                return True
            if isinstance(exc, httpx.TransportError):
                return policy.after_send
            if isinstance(exc, ChunkGroupError):
                return False
            if isinstance(exc, ServerError):
                return exc.status in policy.statuses and exc.code not in FINAL_CODES
            return False

        retrying = Retrying(
            stop=stop_after_attempt(1 + self.backend.max_retries),
            wait=retry_wait(self.backend.retry_initial_wait, self.backend.retry_max_wait),
            retry=retry_if_exception(retryable),
            before_sleep=lambda rs: log.info(
                "%s: retrying after %s (attempt %d)", op, rs.outcome.exception(), rs.attempt_number
            ),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    response = client.request(method, url, **kwargs)
                    if response.status_code >= 400:
                        log_failed(response, op)
                        raise error_from_response(response.status_code, response.content, op=op)
        except httpx.HTTPError as exc:
            raise connection_error(exc, url, op=op) from None
        content_type = response.headers.get("content-type", "")
        return decode_body(bytearray(response.content), content_type, self._tensor_type, op=op)


def _merge_options(base: dict, extra: dict | None) -> dict:
    """Op metadata ``base`` with ``extra`` merged in (``response_options`` merged key by key)."""
    merged = {**base, **(extra or {})}
    key = "response_options"
    if extra and key in extra:
        merged[key] = {**base.get(key, {}), **extra[key]}
    return merged


def _policy(retry: Retry) -> RetryPolicy:
    """The HTTP retry policy of an op's retry class (``contract/ops.py``): only an op safe to
    repeat is retried after its request may have reached the server."""
    return NOT_REPEATABLE if retry == "never" else REPEATABLE


def _chunk_payload(event: dict, op: str) -> bytearray:
    try:
        payload = bytearray(base64.b64decode(event["payload_b64"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise bad_response(f"malformed result chunk: {exc}", op=op) from None
    expected = event.get("payload_sha256")
    if expected is not None and hashlib.sha256(payload).hexdigest() != expected:
        raise bad_response("a result chunk does not match its payload_sha256", op=op)
    return payload


def _failed_request(state: dict, op: str) -> ServerError:
    """The exception for a failed request: the class the same error has on the other backends,
    from our server's ``error_detail``; a server without one gives only the reference's string."""
    detail = state.get("error_detail")
    if isinstance(detail, dict) and isinstance(detail.get("status"), int):
        fields = {k: v for k, v in detail.items() if k != "status"}
        return error_from_fields(detail["status"], fields, op=op)
    text = str(state.get("error") or "the request failed without an error message")
    return server_error(None, "request_failed", text, op=op)
