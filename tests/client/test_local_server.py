"""A launched ``arctic-platform serve`` never outlives its driver, and is never mistaken.

Each test runs the driver as its own Python process (the way a framework's driver runs), launches
the real server through ``LocalServer``, then ends the driver the way real drivers end: returning
without ``shutdown()``, or killed by SIGKILL. The server process must be gone afterwards.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from arctic_platform.client import ArcticRLClientConfig
from arctic_platform.client.errors import BackendUnavailableError
from arctic_platform.client.local_server import LocalServer, free_port
from arctic_platform.client.transports.http import HttpTransport
from tests.waiting import wait_until

DRIVER = textwrap.dedent(
    """
    import sys, time
    from arctic_platform.client.local_server import LocalServer

    server = LocalServer(data_dir=sys.argv[1], device="cpu", startup_timeout=600)
    server.start()
    print(server._process.pid, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(3600)
    """
)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def start_driver(tmp_path, mode: str) -> tuple[subprocess.Popen, int]:
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "data"), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid = int(driver.stdout.readline())
    assert alive(server_pid)
    return driver, server_pid


def test_server_stops_when_the_driver_returns_without_shutdown(tmp_path):
    driver, server_pid = start_driver(tmp_path, "return")
    assert driver.wait(timeout=120) == 0
    wait_until(
        lambda: not alive(server_pid),
        what=f"server process {server_pid} outlived its driver",
        interval_s=0.1,
    )


def test_server_stops_when_the_driver_is_killed(tmp_path):
    driver, server_pid = start_driver(tmp_path, "hang")
    driver.kill()  # SIGKILL: no atexit, no cleanup in the driver
    driver.wait()
    wait_until(
        lambda: not alive(server_pid),
        what=f"server process {server_pid} outlived its driver",
        interval_s=0.1,
    )


class _Stranger(http.server.BaseHTTPRequestHandler):
    """Some other program that answers 200 on /health."""

    def do_GET(self):
        body = json.dumps({"status": "OK"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stranger():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Stranger)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_launch_refuses_a_stranger_on_the_port(tmp_path, stranger):
    server = LocalServer(port=stranger, data_dir=tmp_path / "data", device="cpu")
    with pytest.raises(
        BackendUnavailableError, match="another process answers.*not arctic-platform"
    ):
        server.start()
    assert server._process is None


def test_attaching_to_a_stranger_is_refused(stranger):
    config = ArcticRLClientConfig.model_validate(
        {
            "model": "builtin:tiny",
            "backend": {"type": "http", "url": f"http://127.0.0.1:{stranger}"},
        }
    )
    transport = HttpTransport(config)
    with pytest.raises(BackendUnavailableError, match="not arctic-platform serve"):
        transport.open()
    transport.close()


def test_the_parent_watch_refuses_a_wrong_parent(tmp_path):
    process = subprocess.run(
        [
            sys.executable,
            "-c",
            "from arctic_platform.cli import main; main()",
            "serve",
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path),
            "--parent-pid",
            str(os.getpid() + 10**6),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode != 0 and "--parent-pid" in process.stderr
