"""Start ``arctic-platform serve`` as a child process, wait until it is healthy, stop it.

Used by the ``http`` backend's ``launch_local_server`` and by ``arctic-platform train --backend
http|cortex`` without ``--url``. The child runs with this Python and inherits stdout/stderr, so
its log is visible; if it dies before answering ``/health`` the error carries its exit code.

The launched server never outlives its launcher: it is stopped at interpreter exit (``atexit``,
for drivers that never call ``shutdown()``), and it stops itself when this process dies, even by
SIGKILL (``serve --parent-pid``, :mod:`arctic_platform.server.parent_watch`). It runs as this
user for this user's driver, so it reads and saves wherever the driver's paths point
(``--allow-path / --allow-write-path /``; relative paths still land in its data folder).
Healthy means *our* server answers: the child gets a fresh instance id and ``/health`` must
report it, so another process answering on the port is refused rather than trusted.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from arctic_platform.client.errors import BackendUnavailableError, RequestTimeoutError
from arctic_platform.server_identity import OWN_USER_PREFIXES, identity_problem, new_instance_id

log = logging.getLogger(__name__)


class LocalServer:
    """One ``arctic-platform serve`` child process; a context manager yielding its base URL."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        data_dir: Path | str = "arctic-data",
        device: str = "auto",
        token_env: str | None = None,
        startup_timeout: float = 600.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.data_dir = Path(data_dir)
        self.device = device
        self.token_env = token_env
        self.startup_timeout = startup_timeout
        self.extra_args = extra_args
        self.instance = new_instance_id()
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> str:
        """Launch the server and block until ``/health`` answers; return its base URL."""
        command = [
            sys.executable,
            "-c",
            "from arctic_platform.cli import main; main()",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--device",
            self.device,
            "--log-level",
            "warning",
            "--instance-id",
            self.instance,
            "--parent-pid",
            str(os.getpid()),
            *self.extra_args,
        ]
        for prefix in OWN_USER_PREFIXES:  # this user's own server, for this driver's paths
            command += ["--allow-path", prefix, "--allow-write-path", prefix]
        if self.token_env is not None:
            command += ["--token-env", self.token_env]
        log.info("launching a local server: %s", " ".join(command[3:]))
        self._process = subprocess.Popen(command)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=3.0) as probe:
            while True:
                code = self._process.poll()
                if code is not None:
                    self._process = None
                    atexit.unregister(self.stop)
                    raise BackendUnavailableError(
                        f"the local server exited with code {code} before becoming healthy "
                        "(its log is above)"
                    )
                problem = self._health_problem(probe)
                if problem == "":
                    return self.url
                if problem is not None:
                    self.stop()
                    raise BackendUnavailableError(
                        f"another process answers on {self.url}: {problem}; stop it or "
                        "launch on another port (port: 0 picks a free one)"
                    )
                if time.monotonic() > deadline:
                    self.stop()
                    raise RequestTimeoutError(
                        f"the local server did not answer /health within {self.startup_timeout}s"
                    )
                time.sleep(0.2)

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs (for tools that watch its resources)."""
        return None if self._process is None else self._process.pid

    def _health_problem(self, probe: httpx.Client) -> str | None:
        """``""`` when our server answers ``/health``, why not when something else does, None
        when nothing answers yet."""
        try:
            answer = probe.get(f"{self.url}/health")
            if answer.status_code != 200:
                return None
            body = answer.json()
        except (httpx.HTTPError, ValueError):
            return None
        return identity_problem(body, instance=self.instance) or ""

    def stop(self) -> None:
        """SIGTERM (the server finishes in-flight ops), then SIGKILL after 30 s."""
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
