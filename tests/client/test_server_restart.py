"""A Cortex client whose server restarts under a running op is told the job ended with it."""

from __future__ import annotations

import threading

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.client.errors import ConflictError
from tests.client.conftest import TINY, backend_config, make_app
from tests.live_server import serve_app
from tests.waiting import wait_until


class RestartGate:
    """ASGI middleware standing for the gap of a restart: while ``down``, every answer is a 503
    (what a load balancer gives for a server that is not up), so no poll reads the stopped server
    before the new one is in place (in CI a poll once did, and was told the op stopped rather
    than that its job ended)."""

    def __init__(self, app):
        self.app = app
        self.down = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.down:
            return await self._unavailable(send)
        replaced = False

        async def gated_send(message):
            # A request that was under way when the server went down gets no answer from it.
            nonlocal replaced
            if message["type"] == "http.response.start" and self.down:
                replaced = True
                return await self._unavailable(send)
            if not replaced:
                await send(message)

        await self.app(scope, receive, gated_send)

    @staticmethod
    async def _unavailable(send):
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    @property
    def state(self):
        return self.app.state


def test_an_op_whose_server_restarted_reports_that_the_job_ended(tmp_path):
    from arctic_platform.server.service import Service, ServiceSettings

    data = tmp_path / "server"
    first = Service(ServiceSettings(data_dir=data, device="cpu"))
    app = make_app(first, middleware=RestartGate)
    with serve_app(app) as url:
        # Retries as slow as a real client's: a 404 retried to exhaustion would take a minute.
        backend = backend_config("cortex", url, tmp_path, retry_initial_wait=5, max_retries=8)
        config = {"model": TINY, "seed": 0, "backend": backend, "sampling": {}}
        client = create_arctic_rl_client(config, blocking_calls=True)
        errors: list[BaseException] = []

        def generate() -> None:
            endless = {"n": 2048, "max_tokens": 1000, "ignore_eos": True}
            try:
                client.generate(["1+2="], endless)
            except Exception as exc:
                errors.append(exc)

        waiting = threading.Thread(target=generate)
        waiting.start()

        def submitted() -> bool:
            assert waiting.is_alive(), errors
            return first.busy()

        wait_until(submitted, what="the generate submitted")
        app.down = True
        first.close(drain_timeout=0)  # the server goes down with the op in flight ...
        second = Service(ServiceSettings(data_dir=data, device="cpu"))
        app.state.service = second  # ... and comes back on the same address
        app.down = False
        try:
            waiting.join(timeout=120)
            assert not waiting.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], ConflictError), errors
            # The job ended with the first server (its op was stopped by the shutdown).
            assert "ended (failed: server shut down with ops in flight" in str(errors[0])
        finally:
            client.shutdown()
            second.close()
