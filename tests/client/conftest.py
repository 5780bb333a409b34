"""Fixtures for client tests: our real server (Service + FastAPI app) on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arctic_platform.client.transport import Request, Transport
from tests.live_server import serve_app

TINY = "builtin:tiny"


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    """One real Service for the client tests' servers (jobs are per client)."""
    from arctic_platform.server.service import Service, ServiceSettings

    svc = Service(ServiceSettings(data_dir=tmp_path_factory.mktemp("server"), device="cpu"))
    yield svc
    svc.close()


def make_app(service, tokens=(), middleware=None):
    from arctic_platform.server.app import create_app
    from arctic_platform.server.auth import TokenAuth

    app = create_app(service, auth=TokenAuth(list(tokens)), close_service_on_shutdown=False)
    return app if middleware is None else middleware(app)


@pytest.fixture(scope="session")
def server_url(service) -> Iterator[str]:
    """Base URL of our server (both APIs) on a free 127.0.0.1 port, for the whole session."""
    with serve_app(make_app(service)) as url:
        yield url


def backend_config(kind: str, url: str | None, data_dir: Path, **extra) -> dict:
    """The ``backend:`` section of a test client on ``kind``."""
    if kind == "inprocess":
        backend = {"type": "inprocess", "data_dir": str(data_dir), "device": "cpu"}
    elif kind == "http":
        backend = {"type": "http", "url": url}
    elif kind == "cortex":
        backend = {
            "type": "cortex",
            "base_url": url,
            "database": "DB",
            "schema": "RL",
            "poll_interval": 0.01,
            "poll_max_interval": 0.05,
        }
    else:
        raise ValueError(kind)
    backend.update(extra)
    return backend


class Recording(Transport):
    """Delegates to a real transport and records the requests the client hands it."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.requests: list[Request] = []

    def open(self) -> None:
        self.inner.open()

    def call(self, request: Request) -> Any:
        self.requests.append(request)
        return self.inner.call(request)

    def close(self) -> None:
        self.inner.close()
