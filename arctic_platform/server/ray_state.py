"""The server-state actor: a Service, with Ray engines, living in a Ray actor.

The ``ray`` client backend creates one per client that creates jobs; ``get_server_state()`` hands
out its actor handle, which any Ray task or actor in the cluster can pass to
``create_arctic_rl_client(reconnect_config, server_state)`` to drive the same jobs. Because the
Service lives in the actor (not in the client), every client sees the same job states, the same
per-sub-job op queues and the same failure handling.

The actor is threaded, so a long op on one job does not block others (or status queries); the
Service's own queues keep each sub-job's ops in order. Replies are tagged rather than raised:
``("ok", value)`` or ``("error", {status, code, message, details})``, the HTTP APIs' error body,
which the client turns into the same exception as an HTTP error (exceptions could not cross the
actor boundary faithfully). Tensors in results cross as numpy arrays.

The actor runs on the node of the process that creates it (its ``data_dir`` is that process's
path) and asks for no CPU, so it never competes with engines for resources. Engine actors it
creates share its fate: if the state actor goes away, so do its jobs' workers.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

MAX_CONCURRENT_CALLS = 64
log = logging.getLogger(__name__)


class ServerState:
    """Owns a Ray-backed :class:`~arctic_platform.server.service.Service` (see module doc)."""

    def __init__(
        self, data_dir: str, *, device: str, max_concurrent_ops: int, colocate: bool
    ) -> None:
        from arctic_platform.server.service import Service, ServiceSettings
        from arctic_platform.server_identity import OWN_USER_PREFIXES

        own = tuple(Path(p) for p in OWN_USER_PREFIXES)  # the driver's user's own actor
        self.service = Service(
            ServiceSettings(
                data_dir=Path(data_dir),
                device=device,
                max_concurrent_ops=max_concurrent_ops,
                engine_backend="ray",
                colocate=colocate,
                allowed_paths=own,
                writable_paths=own,
            )
        )

    def execute(self, target: str, op: str, body: Any) -> tuple:
        """Any op, job ops included (``Service.execute``): the Ray transport's one entry."""
        return self._reply(lambda: self.service.execute(target, op, body))

    def get_job(self, job_id: str) -> tuple:
        return self._reply(lambda: self.service.get_job(job_id))

    def list_jobs(self) -> tuple:
        return self._reply(self.service.list_jobs)

    def actors(self, sub_job_id: str) -> tuple:
        """The actor handles running a sub-job (its training ranks, or its replica)."""

        def handles() -> list:
            engine = self.service.resolve(sub_job_id, owner=None).engine
            return [] if engine is None else list(engine.actors.handles)

        return self._reply(handles)

    def close(self) -> None:
        """Stop the Service: in-flight ops finish, every job's actors are released."""
        self.service.close()

    @staticmethod
    def _reply(fn) -> tuple:
        """``fn()`` as a tagged reply. An exception nobody anticipated is the same 500
        ``internal_error`` naming a request id as on the HTTP and Cortex APIs, its traceback
        logged under that id: left to Ray, it would reach the client as a ``RayTaskError``
        carrying the server's traceback, paths included."""
        from arctic_platform.server.errors import ServiceError, internal_error
        from arctic_platform.tensor_tree import to_object_store

        try:
            return ("ok", to_object_store(fn()))
        except Exception as exc:
            if not isinstance(exc, ServiceError):
                request_id = uuid.uuid4().hex
                log.exception("ray request %s failed", request_id)
                exc = internal_error(request_id)
            body = {"status": exc.status, "code": exc.code, "message": exc.message}
            return ("error", {**body, "details": exc.details})


def start_server_state(
    *, data_dir: str, device: str, max_concurrent_ops: int, colocate: bool
) -> Any:
    """Create the server-state actor on this node and wait until its Service is up."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    here = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    actor = (
        ray.remote(ServerState)
        .options(num_cpus=0, max_concurrency=MAX_CONCURRENT_CALLS, scheduling_strategy=here)
        .remote(data_dir, device=device, max_concurrent_ops=max_concurrent_ops, colocate=colocate)
    )
    ray.get(actor.list_jobs.remote())  # surfaces a constructor failure here, not on first use
    return actor
