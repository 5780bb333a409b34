"""The ``inprocess`` backend: the Service and its engines live in this process.

The same Service the HTTP server wraps, called directly: same validation, same op semantics, same
error codes (converted to the client's exception types), no serialisation; the job ops too
(``Service.execute`` runs them). Checkpoints and job
records go to the backend's ``data_dir``.

``server_state`` is the Service itself: ``client.get_server_state()`` returns it and a second
client in this process attaches to the first one's jobs with
``create_arctic_rl_client(client.reconnect_config(), client.get_server_state())``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from arctic_platform._extras import require
from arctic_platform.client.config import ArcticRLClientConfig, InProcessBackend
from arctic_platform.client.errors import server_error
from arctic_platform.client.tensors import resolve_tensor_type, torch_to_numpy
from arctic_platform.client.transport import Request, Transport
from arctic_platform.contract.job_ops import JOB_OPS


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
        self._service_error = ServiceError
        self._tensor_type = resolve_tensor_type(config.tensor_type)
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

    def call(self, request: Request) -> Any:
        result = self._guard(
            lambda: self.service.execute(request.job_id, request.op, request.body), request.op
        )
        return self._convert(result)

    async def acall(self, request: Request) -> Any:
        """Awaits the sub-job queue's future directly: no thread per call, any event loop."""
        if request.op in JOB_OPS:
            return await super().acall(request)
        started = self._guard(
            lambda: self.service.start(request.job_id, request.op, request.body, owner=None),
            request.op,
        )
        try:
            result = await asyncio.wrap_future(started.future)
        except self._service_error as exc:
            raise server_error(
                exc.status, exc.code, exc.message, op=request.op, details=exc.details
            ) from None
        return self._convert(result)

    def close(self) -> None:
        if self._owns_service:
            self._owns_service = False
            self.service.close()

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
