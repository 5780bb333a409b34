"""The op surface frameworks call: ``ArcticRLClient`` (async) and ``SyncArcticRLClient``.

Both create (or attach to) their jobs when constructed and expose the same ops with the same
arguments and the same response shapes on every backend: each op is written once in
:mod:`arctic_platform.client.calls` (its arguments, requests and answer's shape); the classes here
say only how a call is delivered, blocking or awaited (:mod:`arctic_platform.client.transport`).

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
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from arctic_platform.client.calls import Call, ClientOps
from arctic_platform.client.config import ArcticRLClientConfig, load_config
from arctic_platform.client.job_lifecycle import JobLifecycle
from arctic_platform.client.transport import JobHandles, Transport

R = TypeVar("R")


class _ClientBase(ClientOps):
    """Construction, job handles and reconnect support shared by both clients; their ops are
    :class:`~arctic_platform.client.calls.ClientOps`'s."""

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
        self._lifecycle = JobLifecycle(self.transport, self.config)
        try:
            self.transport.open()
            self.jobs: JobHandles = self._lifecycle.start()
        except BaseException:
            self.transport.close()
            raise
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

    def _mark_closed(self) -> bool:
        """Refuse new ops from now on; True for the one call that must release the transport."""
        closing, self._closed = not self._closed, True
        return closing

    def _release(self) -> None:
        """Cancel the jobs this client created, then close the transport."""
        try:
            self._lifecycle.stop()
        finally:
            self.transport.close()

    def close(self) -> None:
        """Release the jobs this client created and its connections, now; idempotent."""
        if self._mark_closed():
            self._release()


class SyncArcticRLClient(_ClientBase):
    """The blocking client: every op returns its result."""

    def _run(self, call: Call[R]) -> R:
        return call.shape([self.transport.call(request) for request in call.requests])

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

    async def _run(self, call: Call[R]) -> R:
        results = [await self.transport.acall(request) for request in call.requests]
        return call.shape(results)

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread, so the event loop keeps running meanwhile."""
        if self._mark_closed():
            await asyncio.to_thread(self._release)

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
        return loop.run_in_executor(None, self._release)

    async def __aenter__(self) -> ArcticRLClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
