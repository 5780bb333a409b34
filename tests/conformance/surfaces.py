"""The surfaces a client reaches the server through, each a function from a Service to a client.

One Service serves every surface of a test module, so their jobs differ only in how the client
reaches them: ``asgi`` (the on-prem API through an ``httpx.MockTransport`` that hands each
request to the app in this thread, no socket), ``inprocess`` (the Service called directly),
``http`` and ``cortex`` (the on-prem and Cortex APIs over 127.0.0.1). Ray runs its own Service in
an actor (``tests/conformance/test_ray.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
from starlette.testclient import TestClient

from arctic_platform.client import create_arctic_rl_client
from tests.client.conftest import backend_config
from tests.server.conftest import TINY, make_app

FAKE_SURFACES = ("asgi", "inprocess", "http", "cortex")
ASGI_URL = "http://asgi.test"


def client_config(backend: dict) -> dict:
    """A client with all three sub-jobs on the built-in tiny model (a fake job ignores the
    model's weights, not its name)."""
    return {
        "model": TINY,
        "seed": 3,
        "tensor_type": "numpy",
        "backend": backend,
        "training": {"optimizer": {"lr": 1e-3}},
        "sampling": {},
        "log_prob": {},
    }


def asgi_transport(app) -> httpx.MockTransport:
    """An ``httpx`` transport that answers each request with ``app`` (an ASGI app) in-process."""
    test_client = TestClient(app, base_url=ASGI_URL)

    def handle(request: httpx.Request) -> httpx.Response:
        answer = test_client.request(
            request.method,
            str(request.url),
            headers=request.headers,
            content=request.read(),
        )
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    return httpx.MockTransport(handle)


def fake_surfaces(service, url: str, data_dir: Path) -> dict[str, Callable[..., object]]:
    """``{surface: make_client}`` for the surfaces of ``service``, whose app is served at ``url``
    (for ``http`` and ``cortex``). ``make_client()`` creates a client with new jobs;
    ``make_client(config)`` one for ``config`` (a reconnect config attaches)."""
    app = make_app(service)

    def maker(kind: str, url: str | None, **options) -> Callable[..., object]:
        def make(config=None):
            config = config or client_config(backend_config(kind, url, data_dir))
            return create_arctic_rl_client(config, blocking_calls=True, **options)

        return make

    return {
        "asgi": maker("http", ASGI_URL, http_transport=asgi_transport(app)),
        "inprocess": maker("inprocess", None, server_state=service),
        "http": maker("http", url),
        "cortex": maker("cortex", url),
    }
