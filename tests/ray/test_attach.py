"""``address: auto`` joins only the cluster the user means (``RAY_ADDRESS``), never a stray one.

A real ``ray start --head`` runs on this machine (the stray cluster); fresh driver processes
connect with ``auto`` with and without ``RAY_ADDRESS`` and report the cluster they joined.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from arctic_platform.client.local_server import free_port
from tests.waiting import wait_until

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

DRIVER = (
    "import logging, ray\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "from arctic_platform.server.ray_cluster import connect\n"
    "connect('auto', num_cpus=1)\n"
    "print('GCS', ray.get_runtime_context().gcs_address, flush=True)\n"
    "ray.shutdown()\n"
)


@pytest.fixture
def stray_cluster():
    """A head node someone left running on this machine; stopped (only it) afterwards."""
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a limit
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            "--block",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield f"127.0.0.1:{port}"
    # Killed outright, every process it started with it: a graceful ``ray stop`` of the head
    # takes half a minute, and ``ray stop`` would stop the other test worker's clusters too.
    cluster = psutil.Process(head.pid).children(recursive=True)
    os.killpg(head.pid, signal.SIGKILL)
    for process in cluster:
        with contextlib.suppress(psutil.Error):
            process.kill()
    head.wait()
    psutil.wait_procs(cluster, timeout=30)
    shutil.rmtree(temp_dir, ignore_errors=True)


def joined(env_extra: dict) -> tuple[str, str]:
    """``(gcs address, log)`` of a fresh driver connecting with ``auto``."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", **env_extra)
    runs = []

    def driven() -> subprocess.CompletedProcess | None:
        """One run of the driver; None while it fails (the head may still be starting)."""
        result = subprocess.run(
            [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=300
        )
        runs.append(result)
        return result if result.returncode == 0 else None

    try:
        result = wait_until(driven, what="a driver joining", interval_s=1)
    except AssertionError:
        raise AssertionError(runs[-1].stderr[-2000:]) from None
    address = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("GCS"))
    return address, result.stderr


def test_auto_ignores_a_stray_cluster_and_joins_ray_address(stray_cluster):
    address, log = joined({"RAY_ADDRESS": stray_cluster})
    assert address.endswith(stray_cluster.split(":")[1])
    assert f"joined the cluster at {stray_cluster} (from RAY_ADDRESS)" in log

    address, log = joined({})
    assert not address.endswith(":" + stray_cluster.split(":")[1])
    assert "started a private single-machine cluster" in log
