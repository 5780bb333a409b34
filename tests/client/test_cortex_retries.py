"""Cortex transport under faults: lost responses, restarts and conflicts of request chunk groups.

A small ASGI wrapper around our real app injects the faults (it is the network between client
and server, not a fake server): it can let the server process the final chunk of a
forward-backward group and then drop the response (503), ask for a group restart, or report a
conflict. Gradients must be applied exactly once: the step's gradient norm and the weights
afterwards match a run without faults.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from arctic_platform import wire
from arctic_platform.client import (
    ChunkGroupError,
    ServerError,
    create_arctic_rl_client,
)
from arctic_platform.layout import training_batch
from tests.client.conftest import TINY, backend_config, make_app
from tests.live_server import serve_app

CHUNK_BYTES = 64 * 1024


class FaultInjector:
    """ASGI middleware: records every forward-backward chunk posted and injects one fault."""

    def __init__(self, app, fault: str) -> None:
        self.app = app
        self.fault = fault
        self.chunks: list[dict] = []  # descriptors of the forward-backward chunks received
        self.injected = 0
        self._done: set = set()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope["type"] != "http" or not path.endswith(("/forward-backward", "/step")):
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        replay = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def receive_again():
            return replay.pop() if replay else await receive()

        if path.endswith("/step"):
            if self.fault == "lose_step_response" and not self._done:
                self._done.add("step")
                return await self._process_then_fail(scope, receive_again, send)
            return await self.app(scope, receive_again, send)
        desc = wire.read_byte_chunk_metadata(body)
        self.chunks.append(desc)
        group, index, last = desc["chunk_group_id"], desc["chunk_idx"], desc["total_chunks"] - 1
        if self.fault == "lose_final_response" and index == last and group not in self._done:
            self._done.add(group)
            return await self._process_then_fail(scope, receive_again, send)
        if self.fault == "restart" and index == 1 and group not in self._done:
            self._done.add(group)
            self.injected += 1
            return await self._answer(send, 409, "chunk_group_restart_required", group)
        if self.fault == "conflict" and group not in self._done:
            self._done.add(group)
            self.injected += 1
            return await self._answer(send, 409, "chunk_group_conflict", group)
        return await self.app(scope, receive_again, send)

    async def _process_then_fail(self, scope, receive, send):
        async def swallow(message):
            return None

        await self.app(scope, receive, swallow)  # the server runs it; the answer is lost
        self.injected += 1
        await self._answer(send, 503, "unavailable", None)

    async def _answer(self, send, status: int, code: str, group) -> None:
        payload = {"message": f"injected fault: {code}", "code": code}
        if group is not None:
            payload["chunk_group_id"] = group
        body = json.dumps(payload).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def training_data() -> dict:
    """A batch big enough to need several 64 KiB chunks."""
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(5, 100, size=20)) for _ in range(16)]
    responses = [list(rng.integers(5, 100, size=int(n))) for n in rng.integers(100, 150, size=16)]
    advantages = rng.standard_normal(16).astype(np.float32)
    return training_batch(prompts, responses, pad_token_id=0, advantages=advantages)


def client_for(url: str, tmp_path):
    backend = backend_config(
        "cortex",
        url,
        tmp_path,
        max_request_bytes=CHUNK_BYTES,
        retry_initial_wait=0.01,
        retry_max_wait=0.05,
        max_retries=3,
    )
    config = {
        "model": TINY,
        "seed": 5,
        "tensor_type": "numpy",
        "backend": backend,
        "training": {"optimizer": {"lr": 1e-3}},
    }
    return create_arctic_rl_client(config, blocking_calls=True)


def one_step(client) -> dict:
    batch = training_data()
    old = client.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    envelope = {
        "batch": {**batch, "old_log_probs": old * batch["response_mask"]},
        "meta": {"batch_num_tokens": int(batch["response_mask"].sum())},
        "processing": {"loss_fn": "verl_grpo"},
    }
    fwd_bwd = client.fwd_bwd(envelope)
    step = client.step()
    final = client.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    return {"fwd_bwd": fwd_bwd, "step": step, "final": final}


@pytest.fixture(scope="module")
def clean_run(server_url, tmp_path_factory):
    with client_for(server_url, tmp_path_factory.mktemp("clean")) as client:
        yield one_step(client)


def faulty(service, fault: str):
    injector = {}

    def wrap(app):
        injector["it"] = FaultInjector(app, fault)
        return injector["it"]

    return serve_app(make_app(service, middleware=wrap)), injector


def test_the_batch_travels_as_several_chunks(service, tmp_path):
    server, injector = faulty(service, "none")
    with server as url, client_for(url, tmp_path) as client:
        one_step(client)
    chunks = injector["it"].chunks
    assert len(chunks) > 1 and {c["total_chunks"] for c in chunks} == {len(chunks)}


def test_lost_final_response_applies_the_gradient_once(clean_run, service, tmp_path):
    server, injector = faulty(service, "lose_final_response")
    with server as url, client_for(url, tmp_path) as client:
        run = one_step(client)
    faults = injector["it"]
    assert faults.injected == 1
    finals = [c for c in faults.chunks if c["chunk_idx"] == c["total_chunks"] - 1]
    assert len(finals) == 2 and finals[0]["chunk_group_id"] == finals[1]["chunk_group_id"]
    # Executed twice, the gradient would have accumulated twice: the norm would double.
    assert run["step"]["grad_norm"] == clean_run["step"]["grad_norm"]
    assert run["step"]["global_steps"] == 1
    assert run["fwd_bwd"]["metrics"] == clean_run["fwd_bwd"]["metrics"]
    np.testing.assert_array_equal(run["final"], clean_run["final"])


def test_restart_required_replays_the_whole_group_once(clean_run, service, tmp_path):
    server, injector = faulty(service, "restart")
    with server as url, client_for(url, tmp_path) as client:
        run = one_step(client)
    chunks = injector["it"].chunks
    total = chunks[0]["total_chunks"]
    assert [c["chunk_idx"] for c in chunks] == [0, 1, *range(total)]
    assert len({c["chunk_group_id"] for c in chunks}) == 1  # replayed with the same group id
    assert run["step"]["grad_norm"] == clean_run["step"]["grad_norm"]
    np.testing.assert_array_equal(run["final"], clean_run["final"])


def test_a_chunk_group_conflict_is_not_retried(service, tmp_path):
    server, injector = faulty(service, "conflict")
    with server as url, client_for(url, tmp_path) as client:
        batch = training_data()
        envelope = {"batch": {**batch, "old_log_probs": np.zeros_like(batch["advantages"])}}
        with pytest.raises(ChunkGroupError) as info:
            client.fwd_bwd(envelope)
        assert info.value.status == 409 and info.value.code == "chunk_group_conflict"
        assert len(injector["it"].chunks) == 1
        assert client.step()["grad_norm"] == 0.0  # nothing reached the engine


def test_a_lost_step_response_is_reported_not_replayed(service, tmp_path):
    """``step`` has no idempotency key: replaying it could update the weights twice."""
    server, _ = faulty(service, "lose_step_response")
    with server as url, client_for(url, tmp_path) as client:
        with pytest.raises(ServerError) as info:
            client.step()
        assert info.value.status == 503
        assert client.step()["global_steps"] == 2  # the first step did run, exactly once
