"""The ``http`` backend: an ``arctic-platform serve`` process, over its on-prem API.

Job ops (``contract/job_ops.py``): ``create-job`` is one ``POST /initialize`` per sub-job config
(each returns when its engine is ready, with the sub-job id), ``get-job`` is ``GET /job/{id}``,
``cancel-job`` is ``POST /destroy?job_id=``. Ops:
``POST /{op}?job_id=<sub-job id>``; tensor bodies (forward-backward, forward, generate) as
streamed DSSST1 frames, everything else JSON; the response is DSSST1 or JSON by its
Content-Type.

Retries: failures to connect (the request never reached the server) and 429 answers (a
per-tenant limit of the server was full, such as its unfinished ops; the server did nothing with
the request) are retried, with backoff; that includes a 429 sent while the body is still being
sent (the limit on bodies being read at once), as the server reads and discards the rest before
the client reads the answer. A connection that breaks after the request was sent is reported,
not replayed: the on-prem API has no idempotency key, and replaying a ``forward-backward`` or
``step`` could apply it twice.

With ``launch_local_server`` the client starts ``arctic-platform serve`` itself
(:class:`arctic_platform.client.local_server.LocalServer`) and stops it at shutdown.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from arctic_platform import wire
from arctic_platform.client.config import ArcticRLClientConfig, HttpBackend
from arctic_platform.client.errors import ArcticRLError, BackendUnavailableError
from arctic_platform.client.local_server import LocalServer
from arctic_platform.client.tensors import resolve_tensor_type
from arctic_platform.client.transport import Request, Transport
from arctic_platform.client.transports.http_common import (
    answer_field,
    connection_error,
    decode_body,
    error_from_response,
    log_failed,
    octet_request,
    read_job_status,
    read_response,
    retry_wait,
)
from arctic_platform.client.transports.liveness import LivenessWatch
from arctic_platform.contract.job_ids import role_of
from arctic_platform.contract.job_ops import JOB_OPS, JobStatus, Route
from arctic_platform.contract.ops import OpName
from arctic_platform.server_identity import identity_problem

log = logging.getLogger(__name__)
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
TOO_MANY_REQUESTS = 429


class HttpTransport(Transport):
    """Talks to one on-prem server (see module doc)."""

    def __init__(
        self, config: ArcticRLClientConfig, *, http_transport: httpx.BaseTransport | None = None
    ) -> None:
        backend = config.backend
        assert isinstance(backend, HttpBackend)
        self.config = config
        self.backend = backend
        self._tensor_type = resolve_tensor_type(config.tensor_type)
        self._server: LocalServer | None = None
        self._base_url = backend.base_url
        headers = {}
        if backend.token_env is not None:
            token = os.environ.get(backend.token_env)
            if not token:
                raise ValueError(
                    f"backend.token_env: the environment variable {backend.token_env} holding "
                    "the server's bearer token is unset or empty"
                )
            headers["Authorization"] = f"Bearer {token}"
        self._headers = headers
        self._client: httpx.Client | None = None
        self._http_transport = http_transport
        self._watch: LivenessWatch | None = None

    # -- connection -------------------------------------------------------------------------

    def open(self) -> None:
        if self.backend.launch_local_server and not self.config.reconnecting:
            backend = self.backend
            self._server = LocalServer(
                host=backend.host,
                port=backend.port,
                data_dir=backend.data_dir,
                device=backend.device,
                token_env=backend.token_env,
                startup_timeout=backend.startup_timeout,
            )
            self._base_url = self._server.start()
        self._client = httpx.Client(
            base_url=self._base_url,
            headers=self._headers,
            timeout=httpx.Timeout(self.backend.request_timeout, connect=10.0),
            transport=self._http_transport,
        )
        if self.backend.liveness_timeout is not None:
            self._watch = LivenessWatch(
                self._base_url, self._headers, self.backend.liveness_timeout
            )
        problem = identity_problem(self._get("/health", op="health"))
        if problem is not None:
            raise BackendUnavailableError(f"backend.url: {self._base_url}: {problem}")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    def reconnect_backend(self) -> HttpBackend:
        """The server's actual URL, not "launch one": a reconnecting client attaches to it."""
        return self.backend.model_copy(update={"url": self._base_url, "launch_local_server": False})

    # -- ops --------------------------------------------------------------------------------

    def call(self, request: Request) -> Any:
        if self._watch is None:
            return self._call(request)
        return self._watch.run(lambda: self._call(request), op=request.op)

    def _call(self, request: Request) -> Any:
        if request.op in JOB_OPS:
            return self._job_op(request)
        params = {"job_id": request.job_id}
        path = f"/{request.op}"
        if request.binary:
            buffers = wire.dumps_buffers(request.body, metadata=request.frame_metadata)
            content, headers = octet_request(buffers)
            return self._send(
                "POST", path, op=request.op, params=params, content=content, headers=headers
            )
        return self._post_json(path, request.body, op=request.op, params=params)

    def _job_op(self, request: Request) -> Any:
        """A job op on the on-prem routes, answered as the contract's result model."""
        op = request.op
        route = JOB_OPS[op].onprem
        if op == OpName.CREATE_JOB:
            return self._create(route, request.body)
        path, params = (
            (route.path.format(job_id=request.job_id), {})
            if "{job_id}" in route.path
            else (route.path, {"job_id": request.job_id})
        )
        if op == OpName.GET_JOB:  # a GET: its body travels as query parameters
            params.update(request.body or {})
            answer = self._send(route.method, path, op=op, params=params)
            return read_job_status(JobStatus.from_onprem, answer).model_dump(mode="json")
        # The reference server's destroy wants the sub-job's type; ours reads only the id.
        role = {"job_type": role_of(request.job_id)}
        self._send(route.method, path, op=op, params=params, json=role)
        return None

    def _create(self, route: Route, body: dict) -> dict:
        """The on-prem API makes one job per sub-job (``/initialize`` returns once its engine
        runs): one call per sub-job config; if one fails, those already made are destroyed."""
        made: list[dict] = []
        try:
            for spec in body["sub_job_configs"]:
                answer = self._send(
                    route.method,
                    route.path,
                    op=OpName.CREATE_JOB,
                    json=spec,
                    timeout=self.backend.job_ready_timeout,
                )
                sub_job_id = str(answer_field(answer, "job_id", OpName.CREATE_JOB))
                made.append({"sub_job_id": sub_job_id, "job_type": role_of(sub_job_id)})
        except BaseException:
            for sub in made:
                try:
                    self._call(Request(OpName.CANCEL_JOB, sub["sub_job_id"]))
                except ArcticRLError as exc:
                    log.warning("could not destroy job %s: %s", sub["sub_job_id"], exc)
            raise
        return {"job_ids": [sub["sub_job_id"] for sub in made], "sub_jobs": made}

    # -- HTTP -------------------------------------------------------------------------------

    def _get(self, path: str, *, op: str) -> Any:
        return self._send("GET", path, op=op)

    def _post_json(self, path: str, body: Any, *, op: str, params=None) -> Any:
        if body is None:
            return self._send("POST", path, op=op, params=params)
        return self._send("POST", path, op=op, params=params, json=body)

    def _send(self, method: str, path: str, *, op: str, timeout=None, **kwargs) -> Any:
        if self._client is None:
            raise ArcticRLError(f"{op}: the transport is not initialized or was shut down")
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=10.0)
        busy = Retrying(
            stop=stop_after_attempt(1 + self.backend.busy_retries),
            wait=retry_wait(0.5, 10.0),
            retry=retry_if_exception_type(_Busy),
            before_sleep=lambda state: log.info(
                "%s: the server is busy (429, attempt %d); retrying", op, state.attempt_number
            ),
            reraise=True,
        )
        try:
            for attempt in busy:
                with attempt:
                    response, body = self._exchange(method, path, op=op, **kwargs)
                    if response.status_code == TOO_MANY_REQUESTS:
                        raise _Busy(response, body)
        except _Busy as refused:  # still busy after the last retry
            response, body = refused.response, refused.body
        if response.status_code >= 400:
            log_failed(response, op)
            raise error_from_response(response.status_code, body, op=op)
        content_type = response.headers.get("content-type", "")
        return decode_body(body, content_type, self._tensor_type, op=op)

    def _exchange(self, method: str, path: str, *, op: str, **kwargs) -> tuple:
        """One request and its whole answer, ``(response, body)``; a failure to connect is
        retried (``connect_retries``), any other transport failure raised as ours."""
        client = self._client
        retrying = Retrying(
            stop=stop_after_attempt(1 + self.backend.connect_retries),
            wait=retry_wait(0.2, 2.0),
            retry=retry_if_exception_type(CONNECT_ERRORS),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    request = client.build_request(method, path, **kwargs)
                    response = client.send(request, stream=True)
                    try:
                        body = read_response(response)
                    finally:
                        response.close()
        except httpx.HTTPError as exc:
            raise connection_error(exc, f"{self._base_url}{path}", op=op) from None
        return response, body


class _Busy(Exception):
    """A 429 answer, to retry (:meth:`HttpTransport._send`)."""

    def __init__(self, response: httpx.Response, body: bytearray) -> None:
        super().__init__(response.status_code)
        self.response = response
        self.body = body
