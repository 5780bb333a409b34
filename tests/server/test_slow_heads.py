"""A request head (request line and headers) must arrive within ``--header-read-timeout``.

Slowloris: connections that send nothing, or a head one header line at a time, cost their client
nothing and need no credentials; before the deadline each was held for as long as the client
liked. The module's server closes a head that is not complete within 1 s; what a well-behaved
client does more slowly (a body after its head, a second request on a kept-alive connection) is
not cut by it.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app

DEADLINE_S = 1.0
PATIENCE_S = 15.0  # how long the test waits for the server to close, far beyond the deadline


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    service = Service(ServiceSettings(data_dir=tmp_path_factory.mktemp("server"), device="cpu"))
    app = create_app(service, auth=TokenAuth([]), close_service_on_shutdown=False)
    with serve_app(app, header_read_timeout=DEADLINE_S) as served:
        yield served
    service.close()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=PATIENCE_S)
    sock.settimeout(0.25)
    return sock


def closed_by_server(sock: socket.socket, trickle: bytes | None) -> bool:
    """Whether the server closes ``sock`` within the test's patience, while the client sends
    ``trickle`` every quarter second (None: nothing)."""
    give_up = time.monotonic() + PATIENCE_S
    while time.monotonic() < give_up:
        try:
            if sock.recv(1024) == b"":
                return True
        except TimeoutError:
            if trickle is not None:
                try:
                    sock.sendall(trickle)
                except OSError:
                    return True
        except OSError:
            return True
    return False


@pytest.mark.parametrize(
    ("opening", "trickle"),
    [(b"", None), (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n")],
    ids=["silent", "one-header-line-at-a-time"],
)
def test_a_head_that_does_not_arrive_in_time_loses_its_connection(url, opening, trickle):
    sock = connect(url)
    sock.sendall(opening)
    with sock:
        assert closed_by_server(sock, trickle)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # others are served


def test_a_body_slower_than_the_head_deadline_is_still_answered(url):
    body = b'{"learning_rate": 0.001}'
    with connect(url) as sock:
        sock.sendall(
            b"POST /step?job_id=nope HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        time.sleep(2 * DEADLINE_S)  # the head is complete: only the body deadline applies
        sock.sendall(body)
        sock.settimeout(PATIENCE_S)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]
    assert b"not found" in answer


def test_a_kept_alive_connection_serves_a_request_after_a_pause(url):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(url) as sock:
        sock.settimeout(PATIENCE_S)
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(2 * DEADLINE_S)  # idle between requests: uvicorn's keep-alive (5 s) applies
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
