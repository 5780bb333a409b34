"""The async client works from any event loop: the test's own, ``asyncio.run`` in a worker thread
(SkyRL's dispatch does this on every step), and several loops one after another.

Each call's answer is compared with the same seeded call on the same jobs, so a call that ran on
a stale, closed or foreign loop cannot pass by accident.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from arctic_platform.client import ArcticRLClient, ArcticRLError, create_arctic_rl_client
from tests.client.conftest import TINY, backend_config
from tests.client.grpo import PROMPTS, SAMPLING, build_batch
from tests.sampled import sampled

KINDS = ("inprocess", "http", "cortex")


@pytest.fixture(scope="module")
def clients(server_url, tmp_path_factory):
    made = {}
    for kind in KINDS:
        config = {
            "model": TINY,
            "seed": 9,
            "tensor_type": "numpy",
            "backend": backend_config(kind, server_url, tmp_path_factory.mktemp(kind)),
            "sampling": {},
        }
        made[kind] = create_arctic_rl_client(config)
    yield made
    for client in made.values():
        client.shutdown()


def in_fresh_thread_loop(coro_factory):
    """``asyncio.run`` in a new thread, the way SkyRL runs client calls from sync code."""
    box = {}

    def work():
        box["value"] = asyncio.run(coro_factory())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return box["value"]


def skyrl_style(coro_factory):
    """SkyRL's fallback: a new event loop run to completion in a one-thread executor."""

    def work():
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coro_factory())
        finally:
            loop.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result()


@pytest.mark.parametrize("kind", KINDS)
def test_calls_from_different_loops_on_one_client(clients, kind):
    client: ArcticRLClient = clients[kind]
    first = asyncio.run(client.generate(PROMPTS, SAMPLING))
    second = in_fresh_thread_loop(lambda: client.generate(PROMPTS, SAMPLING))
    third = skyrl_style(lambda: client.generate(PROMPTS, SAMPLING))
    fourth = asyncio.run(client.generate(PROMPTS, SAMPLING))
    assert sampled(first) == sampled(second) == sampled(third) == sampled(fourth)
    assert len(first) == len(PROMPTS) * SAMPLING["n"]


@pytest.mark.parametrize("kind", KINDS)
def test_training_ops_from_a_worker_thread_loop(clients, kind):
    client: ArcticRLClient = clients[kind]
    batch = build_batch(asyncio.run(client.generate(PROMPTS, SAMPLING)))
    here = asyncio.run(client.fwd_no_grad({"batch": batch}))
    there = in_fresh_thread_loop(lambda: client.fwd_no_grad({"batch": batch}))
    np.testing.assert_array_equal(here["batch"]["logprobs"], there["batch"]["logprobs"])


class GatedSampler:
    """The real sampler behind a gate: ``generate`` waits until the test's event loop opens the
    gate. A client call that blocked the loop would keep the gate shut, so the wait would time
    out (and say so) instead of seeing it opened."""

    def __init__(self, engine, gate: threading.Event) -> None:
        self.engine, self.gate, self.opened = engine, gate, []

    def generate(self, *args, **kwargs):
        self.opened.append(self.gate.wait(timeout=120))
        return self.engine.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


async def test_concurrent_calls_on_the_test_loop(clients, service):
    """Ops of several backends in flight together on one loop, and none blocks the loop: the
    loop itself opens the gate the servers' samplers wait behind, after the calls started."""
    gate = threading.Event()
    gated = []
    for kind in KINDS:
        owner = clients[kind].transport.service if kind == "inprocess" else service
        sub = owner.resolve(clients[kind].sampling_job_id, owner=None)
        gated.append((sub, sub.engine, GatedSampler(sub.engine, gate)))
        sub.engine = gated[-1][2]
    try:
        calls = asyncio.gather(*(clients[kind].generate(PROMPTS, SAMPLING) for kind in KINDS))
        await asyncio.sleep(0)  # every call starts and hands its wait to a thread or future
        gate.set()  # reached only if no call blocked the loop
        results = await calls
    finally:
        for sub, engine, _ in gated:
            sub.engine = engine
    assert [sampler.opened for _, _, sampler in gated] == [[True]] * len(KINDS)
    assert sampled(results[0]) == sampled(results[1]) == sampled(results[2])


@pytest.mark.parametrize("kind", ["http", "cortex"])
async def test_concurrent_calls_on_one_client(clients, kind):
    """One client's connections serve several calls in flight from worker threads."""
    client: ArcticRLClient = clients[kind]
    results = await asyncio.gather(*(client.generate(PROMPTS, SAMPLING) for _ in range(4)))
    assert all(sampled(r) == sampled(results[0]) for r in results)


def test_shutdown_works_awaited_or_not(server_url, tmp_path):
    config = {
        "model": TINY,
        "backend": backend_config("http", server_url, tmp_path),
        "training": None,
        "sampling": {},
    }
    client = create_arctic_rl_client(config)
    asyncio.run(_await(client.shutdown()))
    client.shutdown()  # idempotent, and usable without awaiting
    with pytest.raises(ArcticRLError, match="shut down"):
        asyncio.run(client.generate(PROMPTS, SAMPLING))


async def _await(awaitable):
    return await awaitable
