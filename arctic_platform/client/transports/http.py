"""The ``http`` backend: an ``arctic-platform serve`` process, over its on-prem API.

Jobs: one ``POST /initialize`` per configured job (it returns when the engine is ready, with the
sub-job id), ``POST /destroy?job_id=`` at shutdown for the jobs this client created. Ops:
``POST /{op}?job_id=<sub-job id>``; tensor bodies (forward-backward, forward, generate) as
streamed DSSST1 frames, everything else JSON; the response is DSSST1 or JSON by its
Content-Type.

Retries: only failures to connect are retried (the request never reached the server). A
connection that breaks after the request was sent is reported, not replayed: the on-prem API has
no idempotency key, and replaying a ``forward-backward`` or ``step`` could apply it twice.

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
from arctic_platform.client.errors import ArcticRLError, BackendUnavailableError, server_error
from arctic_platform.client.local_server import LocalServer
from arctic_platform.client.tensors import resolve_tensor_type
from arctic_platform.client.transport import JobHandles, Request, Transport
from arctic_platform.client.transports.http_common import (
    connection_error,
    decode_body,
    error_from_response,
    log_failed,
    octet_request,
    read_response,
    retry_wait,
)
from arctic_platform.client.transports.liveness import LivenessWatch
from arctic_platform.server_identity import identity_problem

log = logging.getLogger(__name__)
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


class HttpTransport(Transport):
    """Talks to one on-prem server (see module doc)."""

    def __init__(
        self, config: ArcticRLClientConfig, *, http_transport: httpx.BaseTransport | None = None
    ) -> None:
        backend = config.backend
        assert isinstance(backend, HttpBackend)
        self.config = config
        self.backend = backend
        self.jobs = JobHandles()
        self._tensor_type = resolve_tensor_type(config.tensor_type)
        self._created: list[tuple[str, str]] = []
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

    # -- lifecycle --------------------------------------------------------------------------

    def initialize(self) -> JobHandles:
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
        if self.config.reconnecting:
            return self._attach()
        specs = self.config.sub_job_configs()
        for (role, _), spec in zip(self.config.jobs().items(), specs, strict=True):
            answer = self._post_json(
                "/initialize", spec, op="initialize", timeout=self.backend.job_ready_timeout
            )
            job_id = str(answer["job_id"])
            self._created.append((job_id, role))
            setattr(self.jobs, role, job_id)
        return self.jobs

    def _attach(self) -> JobHandles:
        for role, job_id in self.config.attach_ids().items():
            info = self._get(f"/job/{job_id}", op="attach")
            status = str(info.get("status", "")).lower()
            if status != "running":
                raise server_error(
                    409,
                    f"job_{status}",
                    f"job {job_id} is {status}: {info.get('reason')}",
                    op="attach",
                )
            setattr(self.jobs, role, job_id)
        return self.jobs

    def shutdown(self) -> None:
        created, self._created = self._created, []
        if self._client is not None:
            for job_id, role in created:
                try:
                    self._post_json(
                        "/destroy",
                        {"job_type": role},
                        op="destroy",
                        params={"job_id": job_id},
                    )
                except ArcticRLError as exc:
                    log.warning("could not destroy job %s: %s", job_id, exc)
            self._client.close()
            self._client = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.jobs = JobHandles()

    def reconnect_backend(self) -> HttpBackend:
        """The server's actual URL, not "launch one": a reconnecting client attaches to it."""
        return self.backend.model_copy(update={"url": self._base_url, "launch_local_server": False})

    # -- ops --------------------------------------------------------------------------------

    def call(self, request: Request) -> Any:
        if self._watch is None:
            return self._call(request)
        return self._watch.run(lambda: self._call(request), op=request.op)

    def _call(self, request: Request) -> Any:
        params = {"job_id": request.job_id}
        path = f"/{request.op}"
        if request.binary:
            buffers = wire.dumps_buffers(request.body, metadata=request.frame_metadata)
            content, headers = octet_request(buffers)
            return self._send(
                "POST", path, op=request.op, params=params, content=content, headers=headers
            )
        return self._post_json(path, request.body, op=request.op, params=params)

    # -- HTTP -------------------------------------------------------------------------------

    def _get(self, path: str, *, op: str) -> Any:
        return self._send("GET", path, op=op)

    def _post_json(self, path: str, body: Any, *, op: str, params=None, timeout=None) -> Any:
        if body is None:
            return self._send("POST", path, op=op, params=params, timeout=timeout)
        return self._send("POST", path, op=op, params=params, json=body, timeout=timeout)

    def _send(self, method: str, path: str, *, op: str, timeout=None, **kwargs) -> Any:
        if self._client is None:
            raise ArcticRLError(f"{op}: the transport is not initialized or was shut down")
        client = self._client
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=10.0)
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
        if response.status_code >= 400:
            log_failed(response, op)
            raise error_from_response(response.status_code, body, op=op)
        content_type = response.headers.get("content-type", "")
        return decode_body(body, content_type, self._tensor_type, op=op)
