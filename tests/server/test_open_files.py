"""The server raises its open-files limit at start: every connection is a file, and under a soft
limit of 1,024 a few tenants' waiting requests would stop it accepting anyone's. Each case runs
in a fresh interpreter started with a low soft limit, as a system's default would start it."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from arctic_platform.server.open_files import WANTED, connection_limit
from tests.live_server import serve_process
from tests.waiting import wait_until

CHECK = """
import resource
from arctic_platform.server.open_files import raise_open_files_limit
print(raise_open_files_limit({wanted}), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _run(wanted: int, soft: int) -> list[int]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def lower() -> None:  # in the child, before it runs: the soft limit it starts with
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(wanted=wanted)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lower,
        check=True,
    )
    return [int(v) for v in done.stdout.split()]


def test_a_low_soft_limit_is_raised_towards_the_hard_one():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    wanted = min(limit, 4096)
    assert _run(wanted, soft=256) == [wanted, wanted]
    # Never lowered, and never above a finite hard limit.
    assert _run(128, soft=256) == [256, 256]
    if hard != resource.RLIM_INFINITY:
        assert _run(hard + 1, soft=256) == [hard, hard]


def test_serve_raises_the_limit_it_was_started_with(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected = WANTED if hard == resource.RLIM_INFINITY else min(WANTED, hard)

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    with serve_process(tmp_path, preexec_fn=lower) as (process, _url):
        limits = Path(f"/proc/{process.pid}/limits").read_text()
    (line,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
    assert int(line.split()[3]) == expected  # the soft limit column


def test_a_flood_of_connections_gets_503s_and_leaves_the_server_its_files(tmp_path):
    """Under a limit of 1,100 open files the server takes ``connection_limit(1100)`` connections
    at once: one more gets 503 at once instead of the files the server needs; once they close, it
    answers again."""

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, 1100))

    limit = connection_limit(1100)
    with serve_process(tmp_path, preexec_fn=low) as (_process, url):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(limit)]
        try:
            wait_until(
                lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503,
                what="a request beyond the connection limit refused",
            )
        finally:
            for connection in idle:
                connection.close()
        wait_until(
            lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200,
            what="the server answering once the connections closed",
        )
