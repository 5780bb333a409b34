"""Our real server for tests: an ASGI app served by uvicorn in a thread on a free loopback port,
or a whole ``arctic-platform serve`` process (for signals: SIGTERM, SIGSTOP)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from arctic_platform.client.local_server import free_port


@contextmanager
def serve_app(app, *, header_read_timeout: float | None = None) -> Iterator[str]:
    """Serve an ASGI ``app`` with uvicorn in a background thread, speaking HTTP as ``serve``
    does (:mod:`arctic_platform.server.http_protocol`); yield its base URL."""
    import uvicorn

    from arctic_platform.server.http_protocol import http_protocol
    from arctic_platform.server.limits import ServerLimits

    port = free_port()
    protocol = http_protocol(header_read_timeout or ServerLimits.header_read_timeout)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=protocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def serve_process(data_dir, *extra: str, env: dict | None = None):
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "arctic_platform.cli",
        "serve",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        *extra,
    ]
    process = subprocess.Popen(
        command, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            output = process.stdout.read().decode(errors="replace")
            process.kill()
            raise RuntimeError(f"server did not start:\n{output}")
        time.sleep(0.1)
    try:
        yield process, url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        process.stdout.close()


@contextmanager
def stopped(process: subprocess.Popen) -> Iterator[None]:
    """The server process stopped (SIGSTOP: it holds its sockets but answers nothing) for the
    body, then continued."""
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def kill_when(
    process: subprocess.Popen,
    condition: Callable[[], bool],
    *,
    give_up: Callable[[], bool] = lambda: False,
    timeout: float = 60.0,
) -> bool:
    """SIGKILL ``process`` the moment ``condition()`` holds, polled back to back: a kill at a
    chosen point of the server's work (a staging folder appearing on disk) rather than after a
    guessed delay. False, with the process left running, when ``give_up()`` holds first (the work
    finished unseen) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not give_up():
        if condition():
            process.kill()
            process.wait(timeout=60)
            return True
    return False
