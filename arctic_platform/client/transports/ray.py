"""The ``ray`` backend: the engines run in Ray actors, and a server-state actor owns the jobs.

* ``create_arctic_rl_client(config)`` with ``backend: {type: ray, address: auto|local|<addr>}``
  attaches to (or starts) a Ray cluster, creates a server-state actor
  (:mod:`arctic_platform.server.ray_state`: a Service whose engines are Ray actors) on this node,
  and creates the configured jobs there. The training job runs data-parallel over
  ``num_training_workers`` worker actors (``data_parallel: ddp`` or ``fsdp``); sampling and
  log-prob jobs are one replica actor each; ``colocate`` shares devices between them.
* ``client.get_server_state()`` returns the state actor's handle and ``client.reconnect_config()``
  the config with the job ids. A Ray task or actor rebuilds a client with
  ``create_arctic_rl_client(reconnect_config, server_state)`` and drives the same jobs; it never
  creates or destroys any. The creating client cancels its jobs and stops the state actor at
  shutdown (and Ray itself if it started it).

Every op is one call on the state actor, so ops, validation, errors and response shapes are the
Service's, exactly as on the other backends. Tensors travel as numpy arrays through the object
store; responses come back as numpy or torch per ``tensor_type`` (torch tensors then view the
read-only object-store memory, as tensors decoded from the wire view their frame).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from arctic_platform._extras import require
from arctic_platform.client.config import ArcticRLClientConfig, RayBackend
from arctic_platform.client.errors import TransportError, server_error
from arctic_platform.client.tensors import resolve_tensor_type
from arctic_platform.client.transport import Request, Transport
from arctic_platform.tensor_tree import numpy_to_torch, to_object_store

SHUTDOWN_TIMEOUT_S = 120.0


def ray_transport(config: ArcticRLClientConfig, server_state: Any = None) -> Transport:
    """The Ray transport (see module doc)."""
    require("ray", "ray", purpose="the ray backend")
    if server_state is not None and not config.reconnecting:
        raise ValueError(
            "server_state: reconnecting also needs the job ids; build the client from "
            "client.reconnect_config() together with client.get_server_state()"
        )
    return RayTransport(config, server_state)


class RayTransport(Transport):
    """Talks to a server-state actor; owns it (and its jobs) unless given one to attach to."""

    def __init__(self, config: ArcticRLClientConfig, server_state: Any = None) -> None:
        import ray

        from arctic_platform.server.ray_cluster import connect

        backend = config.backend
        assert isinstance(backend, RayBackend)
        self.config = config
        self.backend = backend
        self._tensor_type = resolve_tensor_type(config.tensor_type)
        self._started_ray = connect(backend.address, namespace=backend.namespace)
        if server_state is None:
            require("torch", "ray", purpose="the ray backend's engines")
            from arctic_platform.server.ray_state import start_server_state

            try:
                self.state = start_server_state(
                    data_dir=str(Path(backend.data_dir).expanduser().resolve()),
                    device=backend.device,
                    max_concurrent_ops=backend.max_concurrent_ops,
                    colocate=backend.colocate,
                )
            except BaseException:
                self._stop_ray()
                raise
            self._owns_state = True
        elif isinstance(server_state, ray.actor.ActorHandle):
            self.state = server_state
            self._owns_state = False
        else:
            raise TypeError(
                "server_state: the ray backend takes the actor handle another client's "
                f"get_server_state() returned, got {type(server_state).__name__}"
            )

    def close(self) -> None:
        import ray

        if self._owns_state:
            self._owns_state = False
            with contextlib.suppress(Exception):
                ray.get(self.state.close.remote(), timeout=SHUTDOWN_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.kill(self.state)
        self._stop_ray()

    def get_server_state(self) -> Any:
        return self.state

    # -- ops --------------------------------------------------------------------------------

    def call(self, request: Request) -> Any:
        import ray

        ref = self.state.execute.remote(request.job_id, request.op, to_object_store(request.body))
        try:
            reply = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise self._unreachable(request.op, exc) from None
        return self._convert(self._unwrap(reply, request.op))

    async def acall(self, request: Request) -> Any:
        """Awaits the state actor's reply: no thread per call, any event loop."""
        import ray

        ref = self.state.execute.remote(request.job_id, request.op, to_object_store(request.body))
        try:
            reply = await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayActorError as exc:
            raise self._unreachable(request.op, exc) from None
        return self._convert(self._unwrap(reply, request.op))

    # -- internals --------------------------------------------------------------------------

    @staticmethod
    def _unwrap(reply: tuple, op: str) -> Any:
        kind, value = reply
        if kind == "ok":
            return value
        raise server_error(
            value["status"], value["code"], value["message"], op=op, details=value["details"]
        )

    @staticmethod
    def _unreachable(op: str, exc: Exception) -> TransportError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return TransportError(f"{op}: the ray backend's server-state actor is gone: {first}")

    def _convert(self, result: Any) -> Any:
        return numpy_to_torch(result) if self._tensor_type == "torch" else result

    def _stop_ray(self) -> None:
        if self._started_ray:
            import ray

            self._started_ray = False
            ray.shutdown()
