"""The channel to the vLLM worker, exercised with the real worker script in a real process.

The worker runs here under this interpreter, which has no vLLM: its ``start`` fails inside the
worker, which must come back as a :class:`VllmWorkerError` naming the cause while the process
keeps serving; a killed worker must raise :class:`VllmWorkerDied` with its signal and log tail
instead of hanging the caller.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys

import pytest

from arctic_platform.engine.vllm_backend.process import (
    VllmWorkerDied,
    VllmWorkerError,
    WorkerProcess,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="this interpreter has vllm"
)


@pytest.fixture
def worker(tmp_path):
    process = WorkerProcess(sys.executable, env=dict(os.environ), log_path=tmp_path / "w.log")
    yield process
    process.close()


def test_errors_inside_the_worker_come_back_and_it_keeps_serving(worker):
    for _ in range(2):
        with pytest.raises(VllmWorkerError, match="start raised ModuleNotFoundError") as info:
            worker.call("start", timeout=120, model="m", engine_args={})
        assert info.value.kind == "ModuleNotFoundError"
    assert worker.call("shutdown", timeout=60) == {"stopped": True}


def test_a_killed_worker_raises_died_with_its_signal(worker):
    with pytest.raises(VllmWorkerError):
        worker.call("start", timeout=120, model="m", engine_args={})  # it is up and answering
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(
        VllmWorkerDied, match=r"died during reset_prefix_cache \(killed by signal 9\)"
    ):
        worker.call("reset_prefix_cache", timeout=60)
    assert not worker.alive()
