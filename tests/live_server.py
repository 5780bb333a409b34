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
from tests.waiting import wait_until


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

    def started() -> bool:
        assert thread.is_alive(), "the test server's thread ended"
        return server.started

    wait_until(started, what="the test server starting", timeout_s=30, interval_s=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def serve_process(data_dir, *extra: str, env: dict | None = None, preexec_fn=None):
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
        command,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=preexec_fn,  # e.g. the limits the server starts with
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, "the server exited"
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, what="the server's /health", timeout_s=60, interval_s=0.1)
    except AssertionError as exc:
        process.kill()
        output = process.stdout.read().decode(errors="replace")
        raise RuntimeError(f"server did not start ({exc}):\n{output}") from None
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
