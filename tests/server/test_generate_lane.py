"""Generate ops on one sampling sub-job overlap and join one decode; every other op stays ordered.

The queue itself (``SubJobQueue``) is tested with plain functions and events; the server test goes
through the real app over 127.0.0.1: the first generate is held (a hook on the sampler's model)
at its 2nd decode step until the engine reports a second call waiting, which only happens if the
server let the second op reach the engine while the first one runs.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from arctic_platform import wire
from arctic_platform.server.sub_job_queue import SubJobQueue
from tests.server.conftest import OCTET, TINY
from tests.waiting import wait_until

WAIT_S = 60


def test_shared_ops_overlap_and_exclusive_ops_keep_arrival_order():
    queue = SubJobQueue("test", max_shared=2)
    order: list[str] = []
    gates = {name: threading.Event() for name in ("r1", "r2", "w", "r3")}

    def op(name):
        def run():
            order.append(f"{name}+")
            assert gates[name].wait(WAIT_S), f"{name} never released"
            order.append(f"{name}-")
            return name

        return run

    r1 = queue.submit(op("r1"), shared=True)
    r2 = queue.submit(op("r2"), shared=True)
    w = queue.submit(op("w"))
    r3 = queue.submit(op("r3"), shared=True)
    wait_until(lambda: order[:2] in (["r1+", "r2+"], ["r2+", "r1+"]), what="both readers running")
    time.sleep(0.05)
    assert len(order) == 2  # the writer waits for the readers before it, the reader after it too
    gates["r1"].set()
    assert r1.result(WAIT_S) == "r1"
    time.sleep(0.05)
    assert not w.running()  # r2 still runs
    gates["r2"].set()
    assert r2.result(WAIT_S) == "r2"
    wait_until(lambda: "w+" in order, what="the writer to start")
    time.sleep(0.05)
    assert "r3+" not in order  # a later reader waits for the writer
    gates["w"].set()
    gates["r3"].set()
    assert (w.result(WAIT_S), r3.result(WAIT_S)) == ("w", "r3")
    assert order.index("w-") < order.index("r3+")
    queue.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        queue.submit(op("r1"))


def test_at_most_max_shared_ops_run_and_the_rest_stay_cancellable():
    """Shared ops beyond ``max_shared`` (the owner's op slots) wait in the queue, holding no
    thread, so a shutdown still cancels them."""
    queue = SubJobQueue("test", max_shared=2)
    release = threading.Event()
    started: list[int] = []

    def op(i):
        def run():
            started.append(i)
            return release.wait(WAIT_S)

        return run

    futures = [queue.submit(op(i), shared=True) for i in range(5)]
    wait_until(lambda: len(started) == 2, what="two shared ops running")
    time.sleep(0.05)
    assert sorted(started) == [0, 1]
    queue.shutdown(wait=False, cancel_futures=True)
    assert [f.cancelled() for f in futures] == [False, False, True, True, True]
    release.set()
    assert [f.result(WAIT_S) for f in futures[:2]] == [True, True]


def test_a_thread_that_cannot_start_fails_its_op_not_the_queue(monkeypatch):
    queue = SubJobQueue("test")
    original = threading.Thread.start

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    failed = queue.submit(lambda: "never")
    monkeypatch.setattr(threading.Thread, "start", original)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        failed.result(WAIT_S)
    assert queue.submit(lambda: "next").result(WAIT_S) == "next"
    queue.shutdown(wait=True)


def test_shutdown_cancels_queued_ops():
    queue = SubJobQueue("test")
    release = threading.Event()
    running = queue.submit(lambda: release.wait(WAIT_S))
    queued = queue.submit(lambda: "never", shared=True)
    queue.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    release.set()
    assert running.result(WAIT_S) is True


def _generate(http, job_id: str, prompt: str, params: dict) -> list[dict]:
    body = {"prompts": [prompt], "sampling_params": params}
    response = http.post(f"/generate?job_id={job_id}", content=wire.dumps(body), headers=OCTET)
    assert response.status_code == 200, response.text
    return wire.loads(response.content)["results"]


def test_two_generates_on_one_job_join_one_decode_with_sequential_results(http, service):
    response = http.post(
        "/initialize", json={"model_name": TINY, "job_type": "sampling", "seed": 0}
    )
    assert response.status_code == 200, response.text
    job_id = response.json()["job_id"]
    engine = service.resolve(job_id, owner=None).engine
    first = ("The cat", {"seed": 1, "max_tokens": 40, "ignore_eos": True, "logprobs": 0})
    second = ("hello world", {"seed": 2, "max_tokens": 8, "n": 2, "logprobs": 0})

    forwards = {"count": 0}
    reached = threading.Event()

    def hold_until_the_second_arrives(_module, _args):
        forwards["count"] += 1
        if forwards["count"] == 3:  # prefill + 2 decode steps of the first generate
            reached.set()
            wait_until(
                lambda: engine.batch_state()["waiting_calls"] == 1,
                what="the second generate to reach the engine while the first decodes",
            )

    hook = engine.model.register_forward_pre_hook(hold_until_the_second_arrives)
    joins = engine.batch_state()["joins"]
    try:
        with ThreadPoolExecutor(2) as pool:
            a: Future = pool.submit(_generate, http, job_id, *first)
            assert reached.wait(WAIT_S), "the first generate never decoded"
            b: Future = pool.submit(_generate, http, job_id, *second)
            together = a.result(WAIT_S), b.result(WAIT_S)
    finally:
        hook.remove()
    assert engine.batch_state()["joins"] == joins + 1
    alone = _generate(http, job_id, *first), _generate(http, job_id, *second)
    for joined, single in zip(together, alone, strict=True):
        assert [o["token_ids"] for o in joined] == [o["token_ids"] for o in single]
        for x, y in zip(joined, single, strict=True):
            # the reference form: per position, {token_id: {logprob, rank, decoded_token}}
            got = [v["logprob"] for e in x["logprobs"] for v in e.values()]
            want = [v["logprob"] for e in y["logprobs"] for v in e.values()]
            assert got == pytest.approx(want, abs=1e-4)


def test_other_ops_wait_for_running_generates(http, service):
    """A sleep (any op but generate) issued while a generate runs starts only after it ends."""
    response = http.post(
        "/initialize", json={"model_name": TINY, "job_type": "sampling", "seed": 0}
    )
    job_id = response.json()["job_id"]
    engine = service.resolve(job_id, owner=None).engine
    reached, release = threading.Event(), threading.Event()
    forwards = {"count": 0}

    def hold(_module, _args):
        forwards["count"] += 1
        if forwards["count"] == 3:
            reached.set()
            assert release.wait(WAIT_S)

    hook = engine.model.register_forward_pre_hook(hold)
    try:
        with ThreadPoolExecutor(2) as pool:
            params = {"seed": 1, "max_tokens": 10, "ignore_eos": True}
            a = pool.submit(_generate, http, job_id, "The cat", params)
            assert reached.wait(WAIT_S)
            sleep_path = f"/sleep-inference?job_id={job_id}"
            slept = pool.submit(lambda: http.post(sleep_path, json={"level": 1}))
            time.sleep(0.2)
            assert not slept.done()  # it waits for the generate
            release.set()
            assert len(a.result(WAIT_S)[0]["token_ids"]) == 10
            assert slept.result(WAIT_S).status_code == 200, slept.result().text
    finally:
        release.set()
        hook.remove()
