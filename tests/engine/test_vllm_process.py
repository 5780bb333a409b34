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
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

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


def test_concurrent_calls_each_get_their_own_reply(worker):
    """Threads call at once (generates that decode together do): each reply reaches the call it
    answers, here told apart by the op each names (an unknown op's error names it)."""
    ops = [f"no_such_op_{i}" for i in range(8)]
    with ThreadPoolExecutor(len(ops)) as pool:
        errors = list(pool.map(lambda op: _error_of(worker, op), ops))
    for op, error in zip(ops, errors, strict=True):
        assert isinstance(error, VllmWorkerError) and op in str(error), (op, error)
    assert worker.call("shutdown", timeout=60) == {"stopped": True}


def _error_of(worker: WorkerProcess, op: str) -> Exception | None:
    try:
        worker.call(op, timeout=60)
    except Exception as exc:
        return exc
    return None


def test_a_killed_worker_raises_died_with_its_signal(worker):
    with pytest.raises(VllmWorkerError):
        worker.call("start", timeout=120, model="m", engine_args={})  # it is up and answering
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(
        VllmWorkerDied, match=r"died during reset_prefix_cache \(killed by signal 9\)"
    ):
        worker.call("reset_prefix_cache", timeout=60)
    assert not worker.alive()


class FakeLLMEngine:
    """Stands in for vLLM's ``LLMEngine`` (this interpreter has no vLLM): ``step`` as given,
    aborts recorded."""

    def __init__(self, step) -> None:
        self.step = step
        self.aborted: list[str] = []

    def abort_request(self, ids: list[str], internal: bool) -> None:
        self.aborted += ids


def decoding_over(engine: FakeLLMEngine, calls: dict):
    from arctic_platform.engine.vllm_backend import worker as script

    holder = script.Worker()
    holder.llm = SimpleNamespace(llm_engine=engine)
    decoding = script.Decoding(holder)
    for seq, (ids, answer) in calls.items():
        decoding.calls[seq] = script._Call(ids, answer)
        decoding._call_of.update(dict.fromkeys(ids, seq))
    return decoding


def test_a_failed_decode_step_fails_every_call_and_marks_the_engine_broken():
    def step():
        raise RuntimeError("the scheduler's state is corrupt")

    engine = FakeLLMEngine(step)
    decoding = decoding_over(engine, {1: (["1-0", "1-1"], list), 2: (["2-0"], list)})
    replies = dict(decoding.advance())
    assert set(replies) == {1, 2} and not decoding.calls
    for reply in replies.values():
        assert reply["error"]["broken"] and "corrupt" in reply["error"]["message"]
    assert sorted(engine.aborted) == ["1-0", "1-1", "2-0"]


def test_a_call_whose_answer_cannot_be_read_fails_alone():
    def step():
        return [SimpleNamespace(request_id=i, finished=True) for i in ("1-0", "2-0")]

    def unreadable(outputs):
        raise KeyError("logprobs")

    decoding = decoding_over(FakeLLMEngine(step), {1: (["1-0"], unreadable), 2: (["2-0"], len)})
    replies = dict(decoding.advance())
    assert replies[1]["error"]["type"] == "KeyError" and not replies[1]["error"]["broken"]
    assert replies[2] == {"result": 1}


# A worker that answers every request as the real one answers a decode step that raised.
BROKEN_STEP_WORKER = """
import json, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
for line in sock.makefile("rb"):
    seq = json.loads(line)["seq"]
    error = {"type": "RuntimeError", "message": "step failed", "broken": True}
    sock.sendall(json.dumps({"seq": seq, "error": error}).encode() + b"\\n")
"""


def test_a_broken_reply_raises_an_error_that_fails_the_job(tmp_path, monkeypatch):
    from arctic_platform.engine.errors import breaks_engine
    from arctic_platform.engine.vllm_backend import process

    script = tmp_path / "broken_worker.py"
    script.write_text(BROKEN_STEP_WORKER)
    monkeypatch.setattr(process, "WORKER_SCRIPT", script)
    channel = WorkerProcess(sys.executable, env=dict(os.environ), log_path=tmp_path / "w.log")
    try:
        with pytest.raises(process.VllmEngineBroken, match="step failed") as raised:
            channel.call("generate", timeout=60, requests=[])
        assert breaks_engine(raised.value)
    finally:
        channel.close(timeout=1)
