"""The op surface frameworks call: ``ArcticRLClient`` (async) and ``SyncArcticRLClient``.

Both create (or attach to) their jobs when constructed and expose the same ops with the same
arguments and the same response shapes on every backend (see :mod:`arctic_platform.client.calls`
for the bodies and shapes, :mod:`arctic_platform.client.transport` for delivery).

Event loops: the async client binds nothing to a loop. Its ops hand the blocking transport call
to a worker thread (``asyncio.to_thread``; the in-process transport awaits the Service's future
directly), so the same client works from any loop: the framework's main loop, a fresh
``asyncio.run`` in a worker thread (as SkyRL's dispatch does on every step), or several loops one
after another. Cancelling an awaiting task does not recall an op already sent; it still runs.

Reconnecting: ``reconnect_config()`` is the config with the job ids filled in, and
``get_server_state()`` whatever else a second client needs (the in-process Service; ``None`` for
the HTTP backends, where the ids suffice). ``create_arctic_rl_client(reconnect_config,
server_state)`` attaches to the same jobs; the attached client never destroys them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from arctic_platform.client.calls import SYNCHRONOUS_SAVES, Call, OpCalls
from arctic_platform.client.config import ArcticRLClientConfig, load_config
from arctic_platform.client.errors import ArcticRLError
from arctic_platform.client.transport import JobHandles, Transport, initialize_or_cleanup


class _ClientBase:
    """Construction, job handles and reconnect support shared by both clients."""

    def __init__(
        self,
        config: ArcticRLClientConfig | Mapping | str,
        server_state: Any = None,
        *,
        transport: Transport | None = None,
        http_transport: Any = None,
    ) -> None:
        """``transport``: deliver ops through this :class:`Transport` instead of the configured
        backend's (a :class:`~arctic_platform.client.transports.mock.MockTransport` in tests).
        ``http_transport``: an ``httpx.BaseTransport`` the ``http`` and ``cortex`` backends send
        through (fault injection, proxies, recording)."""
        from arctic_platform.client.transports import make_transport

        self.config = load_config(config)
        self.transport = transport or make_transport(
            self.config, server_state, http_transport=http_transport
        )
        self.jobs: JobHandles = initialize_or_cleanup(self.transport)
        self._calls = OpCalls(self.jobs, self.config)
        self._closed = False

    @property
    def training_job_id(self) -> str | None:
        return self.jobs.training

    @property
    def sampling_job_id(self) -> str | None:
        return self.jobs.sampling

    @property
    def log_prob_job_id(self) -> str | None:
        return self.jobs.log_prob

    def reconnect_config(self) -> ArcticRLClientConfig:
        """This config with the job ids set: another client built from it attaches to them."""
        update: dict[str, Any] = {
            "training_job_id": self.jobs.training,
            "sampling_job_id": self.jobs.sampling,
            "log_prob_job_id": self.jobs.log_prob,
        }
        backend = self.transport.reconnect_backend()
        if backend is not None:
            update["backend"] = backend
        return self.config.model_copy(update=update)

    def get_server_state(self) -> Any:
        """What a reconnecting client needs besides the ids (None when the ids suffice)."""
        return self.transport.get_server_state()

    def _calls_or_raise(self) -> OpCalls:
        if self._closed:
            raise ArcticRLError("this client was closed (shut down); create a new one")
        return self._calls

    def _mark_closed(self) -> bool:
        """Refuse new ops from now on; True for the one call that must release the transport."""
        closing, self._closed = not self._closed, True
        return closing

    def close(self) -> None:
        """Release the jobs this client created and its connections, now; idempotent."""
        if self._mark_closed():
            self.transport.shutdown()


class SyncArcticRLClient(_ClientBase):
    """The blocking client: every op returns its result."""

    def _run(self, call: Call) -> Any:
        return call.shape([self.transport.call(request) for request in call.requests])

    def fwd_bwd(
        self,
        batch: Mapping,
        processing: Mapping | None = None,
        router_replay: Any = None,
        *,
        meta: Mapping | None = None,
        loss_fn: str | None = None,
        loss_fn_config: Mapping | None = None,
    ) -> dict:
        """Accumulate the gradient of the batch's loss: ``{job_id, loss, avg_loss, metrics}``."""
        ops = self._calls_or_raise()
        return self._run(
            ops.fwd_bwd(batch, processing, router_replay, meta, loss_fn, loss_fn_config)
        )

    def fwd_no_grad(
        self,
        batch: Mapping,
        reference_model: bool = False,
        *,
        processing: Mapping | None = None,
        meta: Mapping | None = None,
    ) -> dict:
        """Log-probs without gradients (the reference model with ``reference_model=True``)."""
        return self._run(
            self._calls_or_raise().fwd_no_grad(batch, reference_model, processing, meta)
        )

    def step(self, learning_rate: float | None = None) -> dict:
        """Apply the accumulated gradients: ``{job_id, global_steps, last_lr, grad_norm, ...}``."""
        return self._run(self._calls_or_raise().step(learning_rate))

    def save_checkpoint(
        self,
        checkpoint_id: str | None = None,
        checkpoint_type: str = "resumable",
        path: str | None = None,
        *,
        step: int | None = None,
        export_hf: bool = False,
        save_total_limit: int | None = None,
        stage_info: Mapping | None = None,
    ) -> dict:
        """Save weights, optimizer and schedule: ``{path, checkpoint_id, global_step, hf_path}``."""
        return self._run(
            self._calls_or_raise().save_checkpoint(
                checkpoint_id, checkpoint_type, path, step, export_hf, save_total_limit, stage_info
            )
        )

    def load_checkpoint(
        self,
        path: str | None = None,
        *,
        step: int | None = None,
        checkpoint_id: str | None = None,
        source_job_id: str | None = None,
    ) -> dict:
        """Restore a checkpoint by folder (``path``, ``step``) or by ``checkpoint_id``."""
        return self._run(
            self._calls_or_raise().load_checkpoint(path, step, checkpoint_id, source_job_id)
        )

    def finalize_pending_saves(self) -> dict:
        """Saves are synchronous here, so nothing is ever pending; says so."""
        self._calls_or_raise()
        return dict(SYNCHRONOUS_SAVES)

    def generate(
        self,
        prompts: Sequence | None = None,
        sampling_params: Mapping | Sequence | None = None,
        routing_key: Any = None,
        strict: bool = False,
        *,
        prompt_ids: Sequence | None = None,
    ) -> list:
        """One result per prompt and sample: ``{text, token_ids, finish_reason, ...}``."""
        return self._run(
            self._calls_or_raise().generate(
                prompts, sampling_params, routing_key, strict, prompt_ids
            )
        )

    def log_probs(
        self, prompts: Sequence, completions: Sequence | None = None, top_k: int = 1
    ) -> dict:
        """Per-token log-probs of completions under the reference (log-prob) model."""
        return self._run(self._calls_or_raise().log_probs(prompts, completions, top_k))

    def sync_weights(self, cuda_ipc: bool | None = None, low_memory: bool | None = None) -> dict:
        """Copy the trainer's weights into the sampler (wake, sync, wake KV cache, reset cache)."""
        return self._run(self._calls_or_raise().sync_weights(cuda_ipc, low_memory))

    def reset_prefix_cache(
        self, drain: bool = True, timeout_s: float = 60.0, retry_interval_s: float = 0.1
    ) -> dict:
        return self._run(
            self._calls_or_raise().reset_prefix_cache(drain, timeout_s, retry_interval_s)
        )

    def sleep_inference(self, level: int = 1) -> dict:
        return self._run(self._calls_or_raise().sleep_inference(level))

    def wake_inference(self, tags: Sequence[str] | None = None) -> dict:
        return self._run(self._calls_or_raise().wake_inference(tags))

    def sleep_training(self, mode: str = "all") -> dict:
        return self._run(self._calls_or_raise().sleep_training(mode))

    def wake_training(self) -> dict:
        return self._run(self._calls_or_raise().wake_training())

    def empty_training_cache(self) -> dict:
        return self._run(self._calls_or_raise().empty_training_cache())

    def shutdown(self) -> None:
        """The older name of :meth:`close`."""
        self.close()

    def __enter__(self) -> SyncArcticRLClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Done:
    """An awaitable that is already complete: ``shutdown()`` outside an event loop."""

    def __await__(self):
        return iter(())


class ArcticRLClient(_ClientBase):
    """The async client: every op is a coroutine, usable from any event loop (module doc)."""

    async def _run(self, call: Call) -> Any:
        results = [await self.transport.acall(request) for request in call.requests]
        return call.shape(results)

    async def fwd_bwd(
        self,
        batch: Mapping,
        processing: Mapping | None = None,
        router_replay: Any = None,
        *,
        meta: Mapping | None = None,
        loss_fn: str | None = None,
        loss_fn_config: Mapping | None = None,
    ) -> dict:
        """Accumulate the gradient of the batch's loss: ``{job_id, loss, avg_loss, metrics}``."""
        ops = self._calls_or_raise()
        return await self._run(
            ops.fwd_bwd(batch, processing, router_replay, meta, loss_fn, loss_fn_config)
        )

    async def fwd_no_grad(
        self,
        batch: Mapping,
        reference_model: bool = False,
        *,
        processing: Mapping | None = None,
        meta: Mapping | None = None,
    ) -> dict:
        """Log-probs without gradients (the reference model with ``reference_model=True``)."""
        ops = self._calls_or_raise()
        return await self._run(ops.fwd_no_grad(batch, reference_model, processing, meta))

    async def step(self, learning_rate: float | None = None) -> dict:
        """Apply the accumulated gradients: ``{job_id, global_steps, last_lr, grad_norm, ...}``."""
        return await self._run(self._calls_or_raise().step(learning_rate))

    async def save_checkpoint(
        self,
        checkpoint_id: str | None = None,
        checkpoint_type: str = "resumable",
        path: str | None = None,
        *,
        step: int | None = None,
        export_hf: bool = False,
        save_total_limit: int | None = None,
        stage_info: Mapping | None = None,
    ) -> dict:
        """Save weights, optimizer and schedule: ``{path, checkpoint_id, global_step, hf_path}``."""
        return await self._run(
            self._calls_or_raise().save_checkpoint(
                checkpoint_id, checkpoint_type, path, step, export_hf, save_total_limit, stage_info
            )
        )

    async def load_checkpoint(
        self,
        path: str | None = None,
        *,
        step: int | None = None,
        checkpoint_id: str | None = None,
        source_job_id: str | None = None,
    ) -> dict:
        """Restore a checkpoint by folder (``path``, ``step``) or by ``checkpoint_id``."""
        return await self._run(
            self._calls_or_raise().load_checkpoint(path, step, checkpoint_id, source_job_id)
        )

    async def finalize_pending_saves(self) -> dict:
        """Saves are synchronous here, so nothing is ever pending; says so."""
        self._calls_or_raise()
        return dict(SYNCHRONOUS_SAVES)

    async def generate(
        self,
        prompts: Sequence | None = None,
        sampling_params: Mapping | Sequence | None = None,
        routing_key: Any = None,
        strict: bool = False,
        *,
        prompt_ids: Sequence | None = None,
    ) -> list:
        """One result per prompt and sample: ``{text, token_ids, finish_reason, ...}``."""
        ops = self._calls_or_raise()
        return await self._run(
            ops.generate(prompts, sampling_params, routing_key, strict, prompt_ids)
        )

    async def log_probs(
        self, prompts: Sequence, completions: Sequence | None = None, top_k: int = 1
    ) -> dict:
        """Per-token log-probs of completions under the reference (log-prob) model."""
        return await self._run(self._calls_or_raise().log_probs(prompts, completions, top_k))

    async def sync_weights(
        self, cuda_ipc: bool | None = None, low_memory: bool | None = None
    ) -> dict:
        """Copy the trainer's weights into the sampler (wake, sync, wake KV cache, reset cache)."""
        return await self._run(self._calls_or_raise().sync_weights(cuda_ipc, low_memory))

    async def reset_prefix_cache(
        self, drain: bool = True, timeout_s: float = 60.0, retry_interval_s: float = 0.1
    ) -> dict:
        ops = self._calls_or_raise()
        return await self._run(ops.reset_prefix_cache(drain, timeout_s, retry_interval_s))

    async def sleep_inference(self, level: int = 1) -> dict:
        return await self._run(self._calls_or_raise().sleep_inference(level))

    async def wake_inference(self, tags: Sequence[str] | None = None) -> dict:
        return await self._run(self._calls_or_raise().wake_inference(tags))

    async def sleep_training(self, mode: str = "all") -> dict:
        return await self._run(self._calls_or_raise().sleep_training(mode))

    async def wake_training(self) -> dict:
        return await self._run(self._calls_or_raise().wake_training())

    async def empty_training_cache(self) -> dict:
        return await self._run(self._calls_or_raise().empty_training_cache())

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread, so the event loop keeps running meanwhile."""
        if self._mark_closed():
            await asyncio.to_thread(self.transport.shutdown)

    def shutdown(self) -> Awaitable[None]:
        """The older name of closing, usable plainly or awaited (``await client.shutdown()``).

        Outside an event loop it closes now and returns a completed awaitable. Inside a running
        loop it starts closing in a worker thread at once (so the work happens even if nobody
        awaits) and returns a future to await: the loop is never blocked.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.close()
            return _Done()
        if not self._mark_closed():
            return _Done()
        return loop.run_in_executor(None, self.transport.shutdown)

    async def __aenter__(self) -> ArcticRLClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
