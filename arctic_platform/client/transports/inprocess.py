"""The ``inprocess`` backend: the Service and its engines live in this process.

The same Service the HTTP server wraps, called directly: same validation, same op semantics, same
error codes (converted to the client's exception types), no serialisation. Checkpoints and job
records go to the backend's ``data_dir``.

``server_state`` is the Service itself: ``client.get_server_state()`` returns it and a second
client in this process attaches to the first one's jobs with
``create_arctic_rl_client(client.reconnect_config(), client.get_server_state())``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from arctic_platform._extras import require
from arctic_platform.client.config import ArcticRLClientConfig, InProcessBackend
from arctic_platform.client.errors import RequestTimeoutError, server_error
from arctic_platform.client.tensors import resolve_tensor_type, torch_to_numpy
from arctic_platform.client.transport import JobHandles, Request, Transport


class InProcessTransport(Transport):
    """Owns (or shares) a :class:`~arctic_platform.server.service.Service`."""

    def __init__(self, config: ArcticRLClientConfig, server_state: Any = None) -> None:
        require("torch", "engine", purpose="the inprocess backend")
        require("transformers", "engine", purpose="the inprocess backend")
        from arctic_platform.server.errors import ServiceError
        from arctic_platform.server.service import Service, ServiceSettings

        backend = config.backend
        assert isinstance(backend, InProcessBackend)
        self.config = config
        self.backend = backend
        self.jobs = JobHandles()
        self._service_error = ServiceError
        self._tensor_type = resolve_tensor_type(config.tensor_type)
        self._created: list[str] = []
        if server_state is None:
            settings = ServiceSettings(
                data_dir=backend.data_dir,
                device=backend.device,
                max_concurrent_ops=backend.max_concurrent_ops,
                confine_paths=False,  # the Service serves only this process's user
            )
            self.service = Service(settings)
            self._owns_service = True
        elif isinstance(server_state, Service):
            self.service = server_state
            self._owns_service = False
        else:
            raise TypeError(
                "server_state: the inprocess backend takes the Service another client's "
                f"get_server_state() returned, got {type(server_state).__name__}"
            )

    def initialize(self) -> JobHandles:
        if self.config.reconnecting:
            return self._attach()
        body = self.config.create_job_body()
        info = self._guard(lambda: self.service.create_job(body), "create job")
        job_id = info["job_id"]
        self._created.append(job_id)
        self._wait_running(job_id)
        self.jobs = JobHandles.from_sub_job_ids(sub["sub_job_id"] for sub in info["sub_jobs"])
        return self.jobs

    def _attach(self) -> JobHandles:
        for role, job_id in self.config.attach_ids().items():
            self._guard(lambda job_id=job_id: self.service.resolve(job_id, owner=None), "attach")
            self._wait_running(job_id)
            setattr(self.jobs, role, job_id)
        return self.jobs

    def _wait_running(self, job_id: str) -> None:
        timeout = self.backend.job_ready_timeout
        try:
            self._guard(
                lambda: self.service.wait_until_running(job_id, timeout=timeout), "create job"
            )
        except TimeoutError as exc:
            raise RequestTimeoutError(str(exc)) from None

    def call(self, request: Request) -> Any:
        result = self._guard(
            lambda: self.service.execute(request.job_id, request.op, request.body), request.op
        )
        return self._convert(result)

    async def acall(self, request: Request) -> Any:
        """Awaits the sub-job queue's future directly: no thread per call, any event loop."""
        service = self.service

        def submit():
            sub, op, body = service.dispatch(request.job_id, request.op, request.body, owner=None)
            if sub is None:
                return None, service.inline_operation(request.job_id, op, body, owner=None)
            return service.submit(sub, op, body), None

        future, inline = self._guard(submit, request.op)
        if future is None:
            return self._convert(inline)
        try:
            result = await asyncio.wrap_future(future)
        except self._service_error as exc:
            raise server_error(
                exc.status, exc.code, exc.message, op=request.op, details=exc.details
            ) from None
        return self._convert(result)

    def shutdown(self) -> None:
        created, self._created = self._created, []
        for job_id in created:
            # A job that already ended (failed, terminated) has nothing left to release.
            with contextlib.suppress(self._service_error):
                self.service.cancel_job(job_id)
        if self._owns_service:
            self._owns_service = False
            self.service.close()
        self.jobs = JobHandles()

    def get_server_state(self) -> Any:
        return self.service

    def _guard(self, fn, op: str) -> Any:
        try:
            return fn()
        except self._service_error as exc:
            raise server_error(
                exc.status, exc.code, exc.message, op=op, details=exc.details
            ) from None

    def _convert(self, result: Any) -> Any:
        return torch_to_numpy(result) if self._tensor_type == "numpy" else result
