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
from arctic_platform.client.errors import RequestTimeoutError, TransportError, server_error
from arctic_platform.client.tensors import resolve_tensor_type
from arctic_platform.client.transport import JobHandles, Request, Transport
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
        self.jobs = JobHandles()
        self._tensor_type = resolve_tensor_type(config.tensor_type)
        self._created: list[str] = []
        self._workers = _training_workers(config, backend)
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

    # -- lifecycle --------------------------------------------------------------------------

    def initialize(self) -> JobHandles:
        if self.config.reconnecting:
            return self._attach()
        body = self.config.create_job_body()
        for spec in body["sub_job_configs"]:
            if spec["job_type"] == "training":
                spec["training_config"]["n_gpus"] = self._workers
                spec["training_config"]["data_parallel"] = _data_parallel(self.config)
        info = self._ask("create job", "create_job", body)
        job_id = info["job_id"]
        self._created.append(job_id)
        self._wait_running(job_id)
        self.jobs = JobHandles.from_sub_job_ids(sub["sub_job_id"] for sub in info["sub_jobs"])
        return self.jobs

    def _attach(self) -> JobHandles:
        for role, job_id in self.config.attach_ids().items():
            info = self._ask("attach", "get_job", job_id)
            known = {sub["sub_job_id"] for sub in info["sub_jobs"]}
            if ":" in job_id and job_id not in known:
                raise server_error(404, "not_found", f"sub-job {job_id!r} not found", op="attach")
            self._wait_running(job_id)
            setattr(self.jobs, role, job_id)
        return self.jobs

    def _wait_running(self, job_id: str) -> None:
        self._ask("create job", "wait_until_running", job_id, self.backend.job_ready_timeout)

    def shutdown(self) -> None:
        import ray

        created, self._created = self._created, []
        for job_id in created:
            # A job that already ended (failed, terminated) has nothing left to release.
            with contextlib.suppress(Exception):
                self._ask("shutdown", "cancel_job", job_id)
        if self._owns_state:
            self._owns_state = False
            with contextlib.suppress(Exception):
                ray.get(self.state.close.remote(), timeout=SHUTDOWN_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.kill(self.state)
        self._stop_ray()
        self.jobs = JobHandles()

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

    def _ask(self, op: str, method: str, *args: Any) -> Any:
        import ray

        try:
            reply = ray.get(getattr(self.state, method).remote(*args))
        except ray.exceptions.RayActorError as exc:
            raise self._unreachable(op, exc) from None
        return self._unwrap(reply, op)

    @staticmethod
    def _unwrap(reply: tuple, op: str) -> Any:
        kind, value = reply
        if kind == "ok":
            return value
        if kind == "timeout":
            raise RequestTimeoutError(value)
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


def _training_workers(config: ArcticRLClientConfig, backend: RayBackend) -> int:
    """The training job's worker count: ``num_training_workers``, or the job's ``n_gpus``."""
    training = config.training
    from_job = training is not None and "n_gpus" in training.model_fields_set
    from_backend = "num_training_workers" in backend.model_fields_set
    if from_job and from_backend and training.n_gpus != backend.num_training_workers:
        raise ValueError(
            f"backend.num_training_workers: {backend.num_training_workers} disagrees with "
            f"training.n_gpus: {training.n_gpus}; set one of them"
        )
    return training.n_gpus if from_job else backend.num_training_workers


def _data_parallel(config: ArcticRLClientConfig) -> str:
    """``training.data_parallel``, or the backend's; the two must agree when both are given."""
    backend, training = config.backend, config.training
    chosen = training.data_parallel if training is not None else None
    explicit = "data_parallel" in backend.model_fields_set
    if chosen is not None and explicit and chosen != backend.data_parallel:
        raise ValueError(
            f"backend.data_parallel: {backend.data_parallel} disagrees with "
            f"training.data_parallel: {chosen}; set one of them"
        )
    return chosen or backend.data_parallel
