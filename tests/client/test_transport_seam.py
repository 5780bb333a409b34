"""The transport seam: ``MockTransport`` for code that drives a client, an injectable ``httpx``
transport for faults between client and server, and one way to close a client.

Closing without blocking the event loop is checked without timing: the transport's shutdown waits
for an event that only the loop itself can set, so a close that blocked the loop would find the
event unset (after the wait's timeout) instead of set.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from arctic_platform.client import (
    ArcticRLClient,
    ArcticRLError,
    MockTransport,
    SyncArcticRLClient,
    TransportError,
    create_arctic_rl_client,
)
from tests.client.conftest import TINY, backend_config
from tests.sampled import sampled

CONFIG = {"model": TINY, "sampling": {}}
STEP = {"job_id": "mock:training:0", "global_steps": 1, "last_lr": 1e-5, "grad_norm": 0.5}


def answer_step(request):
    assert request.op == "step" and request.job_id == "mock:training:0"
    return dict(STEP, metrics={})


def test_a_mock_transport_answers_ops_shaped_like_a_server():
    transport = MockTransport(answer_step)
    with SyncArcticRLClient(CONFIG, transport=transport) as client:
        step = client.step(learning_rate=2e-5)
    assert step["metrics"] == {"grad_norm": 0.5, "last_lr": 1e-5}  # shaped by the client
    assert transport.requests[0].body == {"learning_rate": 2e-5}
    assert transport.closed


def test_close_is_idempotent_and_ops_after_it_fail_clearly():
    transport = MockTransport(answer_step)
    client = SyncArcticRLClient(CONFIG, transport=transport)
    client.close()
    client.close()
    client.shutdown()  # the older name
    with pytest.raises(ArcticRLError, match="closed"):
        client.step()


def gated_client() -> tuple[ArcticRLClient, threading.Event, dict]:
    gate, seen = threading.Event(), {}

    def on_close():
        seen["gate_was_set_by_the_loop"] = gate.wait(timeout=60)

    client = ArcticRLClient(CONFIG, transport=MockTransport(answer_step, on_close=on_close))
    return client, gate, seen


def test_awaiting_shutdown_does_not_block_the_loop():
    async def scenario():
        client, gate, seen = gated_client()
        pending = client.shutdown()  # returns at once; the close runs in a worker thread
        gate.set()  # this line runs on the loop while the close is waiting for it
        await pending
        return seen

    assert asyncio.run(scenario()) == {"gate_was_set_by_the_loop": True}


def test_aclose_and_async_with_do_not_block_the_loop():
    async def scenario():
        client, gate, seen = gated_client()

        async def open_the_gate():
            gate.set()

        async with client:
            opener = asyncio.ensure_future(open_the_gate())
        await opener
        return seen

    assert asyncio.run(scenario()) == {"gate_was_set_by_the_loop": True}


def test_shutdown_in_a_loop_closes_even_when_not_awaited():
    transport = MockTransport(answer_step)

    async def scenario():
        ArcticRLClient(CONFIG, transport=transport).shutdown()

    asyncio.run(scenario())  # asyncio.run waits for the worker thread
    assert transport.closed


class LoseAnswers(httpx.BaseTransport):
    """The network between client and server: loses the answers to the first ``count`` requests
    whose path ends with ``suffix`` after the server has processed them."""

    def __init__(self, suffix: str, count: int = 1) -> None:
        self.inner = httpx.HTTPTransport()
        self.suffix, self.left = suffix, count

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path.endswith(self.suffix) and self.left:
            self.left -= 1
            response.read()
            response.close()
            raise httpx.ReadError("connection reset after the server answered", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


def test_a_step_whose_answer_is_lost_is_reported_not_replayed(server_url, tmp_path):
    config = {
        "model": TINY,
        "backend": backend_config("cortex", server_url, tmp_path, retry_initial_wait=0.01),
        "training": {"optimizer": {"lr": 1e-3}},
    }
    faults = LoseAnswers("/step")
    with create_arctic_rl_client(config, blocking_calls=True, http_transport=faults) as client:
        with pytest.raises(TransportError, match="may or may not have run"):
            client.step()
        assert client.step()["global_steps"] == 2  # the lost step ran once, and only once


def test_a_lost_poll_answer_is_retried(server_url, tmp_path):
    config = {
        "model": TINY,
        "backend": backend_config("cortex", server_url, tmp_path, retry_initial_wait=0.01),
        "training": None,
        "sampling": {},
    }
    faults = LoseAnswers("", count=0)
    with create_arctic_rl_client(config, blocking_calls=True, http_transport=faults) as client:
        expected = client.generate(["1+1="], {"max_tokens": 4, "seed": 1})
        faults.suffix, faults.left = "", 1  # lose the next answer: the generate submission's
        again = client.generate(["1+1="], {"max_tokens": 4, "seed": 1})
        assert sampled(again) == sampled(expected)


def test_http_transport_applies_only_to_http_backends(tmp_path):
    config = {"model": TINY, "backend": {"type": "inprocess", "data_dir": str(tmp_path)}}
    with pytest.raises(ValueError, match="http_transport"):
        create_arctic_rl_client(config, http_transport=httpx.HTTPTransport())
