"""A sub-job's op queue: shared ops (generates on a batching sampler) overlap, and the order of
state-changing ops relative to them is the order they arrived in."""

from __future__ import annotations

import threading

import pytest

from arctic_platform.server.op_queue import OpQueue, SharedSlot
from arctic_platform.server.scheduler import FairSlots

WAIT_S = 30


def _op(log: list, name: str, release: threading.Event | None = None):
    started = threading.Event()

    def run():
        log.append(f"{name} start")
        started.set()
        if release is not None:
            assert release.wait(WAIT_S), f"{name} was never released"
        log.append(f"{name} end")
        return name

    return run, started


def test_shared_ops_overlap_and_exclusive_ops_keep_arrival_order():
    queue, log = OpQueue("test"), []
    release_a, release_b = threading.Event(), threading.Event()
    gen_a, a_started = _op(log, "generate-a", release_a)
    gen_b, b_started = _op(log, "generate-b", release_b)
    sync, _ = _op(log, "weight-sync")
    gen_c, _ = _op(log, "generate-c")
    futures = [
        queue.submit(gen_a, shared=True),
        queue.submit(gen_b, shared=True),
        queue.submit(sync),
        queue.submit(gen_c, shared=True),
    ]
    assert a_started.wait(WAIT_S) and b_started.wait(WAIT_S)  # both generates run at once
    assert log == ["generate-a start", "generate-b start"] or log == [
        "generate-b start",
        "generate-a start",
    ]
    release_a.set()
    futures[0].result(WAIT_S)
    assert "weight-sync start" not in log  # waits for generate-b, which came before it
    release_b.set()
    assert [f.result(WAIT_S) for f in futures] == [
        "generate-a",
        "generate-b",
        "weight-sync",
        "generate-c",
    ]
    # The sync ran alone, after both earlier generates and before the later one.
    assert log[-4:] == [
        "weight-sync start",
        "weight-sync end",
        "generate-c start",
        "generate-c end",
    ]


def test_a_failed_op_fails_its_future_only_and_shutdown_cancels_queued_ops():
    queue, log = OpQueue("test"), []

    def broken():
        raise ValueError("bad op")

    release = threading.Event()
    blocker, started = _op(log, "blocker", release)
    failed = queue.submit(broken)
    running = queue.submit(blocker)
    queued = queue.submit(_op(log, "never")[0])
    with pytest.raises(ValueError, match="bad op"):
        failed.result(WAIT_S)
    assert started.wait(WAIT_S)
    queue.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        queue.submit(lambda: None)
    release.set()
    assert running.result(WAIT_S) == "blocker" and queued.cancelled()
    queue.shutdown(wait=True)
    assert "never start" not in log


def test_overlapping_holders_share_one_server_slot():
    slots = FairSlots(total=1)
    shared = SharedSlot(lambda: slots.slot("tenant"))
    with shared.hold():
        assert slots.running() == 1
        with shared.hold():  # joins without a second slot (there is none)
            assert slots.running() == 1
        assert slots.running() == 1
    assert slots.running() == 0
