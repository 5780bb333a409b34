"""The Cortex-compatible API: create, async requests, chunk groups, checkpoints."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from arctic_platform import wire
from arctic_platform.engine.config import ModelConfig
from arctic_platform.engine.models import load_tokenizer
from arctic_platform.server import async_requests
from tests.server.conftest import CORTEX, OCTET, TINY, job_request
from tests.server.helpers import PROMPTS, SAMPLING, grpo_batch, same_weights, weights_of
from tests.waiting import wait_until

RESPONSE_OPTIONS = {"response_options": {"format": "dssst1", "delivery": "chunked"}}


def create(http, request=None) -> str:
    response = http.post(CORTEX, json=request or job_request())
    assert response.status_code == 200, response.text
    job_id = response.json()["job_id"]

    def running() -> bool:
        status = http.get(f"{CORTEX}/{job_id}").json()["status"]
        assert status in ("pending", "initializing", "running"), status
        return status == "running"

    wait_until(running, what=f"job {job_id} running", interval_s=0.05)
    return job_id


def wait(http, job_id: str, request_id: str):
    """Poll like a Cortex client: drain result chunks by cursor, decode the result."""
    chunks, cursor = [], None

    def finished() -> dict | None:
        nonlocal cursor
        while True:  # every page of events, then the request's status
            params = {"cursor": cursor} if cursor else {}
            body = http.get(f"{CORTEX}/{job_id}/requests/{request_id}", params=params).json()
            chunks.extend(
                base64.b64decode(e["payload_b64"])
                for e in body["events"]
                if e["type"] == "result_chunk"
            )
            if not body["next_cursor"]:
                break
            cursor = body["next_cursor"]
        assert body["status"] in ("pending", "running", "done"), body
        return body if body["status"] == "done" else None

    body = wait_until(finished, what=f"request {request_id}")
    if chunks:
        return wire.decode_result_chunks(chunks, tensor_type="torch")
    result = body["result"]
    if isinstance(result, dict) and result.get("wire_format") == "DSSST1":
        return wire.loads(base64.b64decode(result["payload_b64"]), tensor_type="torch")
    return result


def post_chunks(http, job_id: str, route: str, chunks: list[bytes]) -> list[httpx.Response]:
    return [http.post(f"{CORTEX}/{job_id}/{route}", content=c, headers=OCTET) for c in chunks]


def submit_frame(http, job_id: str, route: str, body, *, max_bytes=0, force=False):
    frame = wire.dumps(body, metadata=RESPONSE_OPTIONS)
    chunks = wire.encode_byte_chunks(
        frame, kind="request", operation=route, max_bytes=max_bytes, force_chunk=force
    )
    responses = post_chunks(http, job_id, route, chunks)
    assert all(r.status_code == 200 for r in responses), responses[-1].text
    return wait(http, job_id, responses[-1].json()["request_id"])


def training_batch(http, service, job_id):
    generated = submit_frame(
        http, job_id, "generate", {"prompts": PROMPTS, "sampling_params": SAMPLING}
    )["results"]
    tokenizer = service.resolve(job_id, owner=None, kind="sampling").engine.tokenizer
    batch = grpo_batch([tokenizer(p)["input_ids"] for p in PROMPTS], generated, SAMPLING["n"])
    old = submit_frame(http, job_id, "forward-no-grad", {"batch": batch}, max_bytes=1500)
    batch["old_log_probs"] = (
        old["model_outputs"]["logprobs"] if "model_outputs" in old else old["batch"]["logprobs"]
    )
    return batch


def test_a_whole_grpo_step_over_the_cortex_routes(http, service):
    job_id = create(http)
    info = http.get(f"{CORTEX}/{job_id}").json()
    assert {s["sub_job_id"] for s in info["sub_jobs"]} == {
        f"{job_id}:training:0",
        f"{job_id}:sampling:0",
        f"{job_id}:log_prob:0",
    }
    batch = training_batch(http, service, job_id)
    ref = submit_frame(http, job_id, "forward-no-grad", {"batch": batch, "reference_model": True})
    batch["ref_log_prob"] = ref["batch"]["logprobs"]
    train = submit_frame(
        http,
        job_id,
        "forward-backward",
        {"batch": batch, "meta": {}, "processing": {"loss_fn": "verl_grpo"}},
        max_bytes=2000,
    )
    assert {"pg_loss" in k for k in train["metrics"]} and train["avg_loss"] == train["loss"]
    step = wait(
        http,
        job_id,
        http.post(f"{CORTEX}/{job_id}/step", json={"learning_rate": 5e-4}).json()["request_id"],
    )
    assert step["global_steps"] == 1 and step["last_lr"] == 5e-4 and "grad_norm" in step["metrics"]
    saved = wait(http, job_id, http.post(f"{CORTEX}/{job_id}/save", json={}).json()["request_id"])
    assert saved["checkpoint_id"] == "checkpoint-1"
    listed = http.get(f"{CORTEX}/{job_id}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["checkpoint-1"]
    loaded = wait(
        http,
        job_id,
        http.post(f"{CORTEX}/{job_id}/load", json={"checkpoint_id": "checkpoint-1"}).json()[
            "request_id"
        ],
    )
    assert loaded["global_step"] == 1
    sampler = service.resolve(job_id, owner=None, kind="sampling").engine
    before = weights_of(sampler)
    sync = http.post(
        f"{CORTEX}/{job_id}/operation",
        json={
            "operation_type": "weight-sync",
            "sub_job_id": f"{job_id}:training:0",
            "sub_job_type": "training",
            "payload": {
                "source_sub_job_id": f"{job_id}:training:0",
                "target_sub_job_ids": [f"{job_id}:sampling:0"],
            },
        },
    ).json()
    assert wait(http, job_id, sync["request_id"])["status"] == "ok"
    assert not same_weights(before, weights_of(sampler))
    reset = http.post(
        f"{CORTEX}/{job_id}/operation",
        json={
            "operation_type": "reset-prefix-cache",
            "sub_job_type": "sampling",
            "payload": {"drain": True, "timeout_s": 60.0, "retry_interval_s": 0.1},
        },
    )
    assert reset.status_code == 200 and "request_id" not in reset.json()
    logs = http.post(f"{CORTEX}/{job_id}/operation", json={"operation_type": "tail-logs"}).json()
    assert any("engine ready" in line for line in logs["entries"])
    log_probs = wait(
        http,
        job_id,
        http.post(
            f"{CORTEX}/{job_id}/log-probs", json={"prompts": ["ab"], "completions": ["c"]}
        ).json()["request_id"],
    )
    assert len(log_probs["results"][0]["logprobs"]) == 1


def test_duplicated_and_out_of_order_chunk_groups_apply_gradients_once(http, service):
    job_id = create(http)
    batch = training_batch(http, service, job_id)
    trainer = service.resolve(job_id, owner=None, kind="training").engine
    frame = wire.dumps({"batch": batch, "meta": {}, "processing": {}}, metadata=RESPONSE_OPTIONS)
    chunks = wire.encode_byte_chunks(
        frame, kind="request", operation="forward-backward", max_bytes=1500
    )
    assert len(chunks) >= 4
    # Out of order after chunk 0: the group completes on whichever chunk arrives last.
    order = [chunks[0], *chunks[2:], chunks[1]]
    replies = []
    for chunk in order:
        reply = http.post(f"{CORTEX}/{job_id}/forward-backward", content=chunk, headers=OCTET)
        replies.append(reply)
    assert (
        replies[-2].status_code == 409
        and replies[-2].json()["code"] == "chunk_group_missing_chunks"
    )
    assert replies[-2].json()["missing_chunks"] == [1]
    request_id = replies[-1].json()["request_id"]
    first = wait(http, job_id, request_id)
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    # The whole group again (a client retrying after a lost response): same request, no rerun.
    again = post_chunks(http, job_id, "forward-backward", chunks)
    assert {r.json().get("request_id") for r in again if "request_id" in r.json()} == {request_id}
    assert wait(http, job_id, request_id) == first
    for name, param in trainer.model.named_parameters():
        if param.grad is not None:
            assert torch.equal(param.grad, grads[name]), name


def test_chunk_group_protocol_errors(http, service):
    job_id = create(http, job_request("training"))
    frame = wire.dumps({"batch": {"input_ids": torch.ones(2, 300, dtype=torch.long)}})
    chunks = wire.encode_byte_chunks(frame, kind="request", max_bytes=1200, chunk_group_id="g1")
    late = http.post(f"{CORTEX}/{job_id}/forward-backward", content=chunks[1], headers=OCTET)
    assert late.status_code == 409 and late.json()["code"] == "chunk_group_restart_required"
    assert (
        http.post(
            f"{CORTEX}/{job_id}/forward-backward", content=chunks[0], headers=OCTET
        ).status_code
        == 200
    )
    other = wire.dumps({"batch": {"input_ids": torch.zeros(2, 300, dtype=torch.long)}})
    clash = wire.encode_byte_chunks(other, kind="request", max_bytes=1200, chunk_group_id="g1")
    conflict = http.post(f"{CORTEX}/{job_id}/forward-backward", content=clash[1], headers=OCTET)
    assert conflict.status_code == 409 and conflict.json()["code"] == "chunk_group_conflict"
    # A chunk whose payload is not the frame's bytes (a string, a number, a 2-D float array)
    # is a 400 naming it (it was a 500 from hashing it) and joins no group.
    descriptor = wire.loads_with_metadata(chunks[0], tensor_type="numpy")[1]["request_chunk"]
    for payload in ("abc", 7, np.zeros((2, 2), np.float32)):
        odd = wire.dumps({"payload": payload}, metadata={"request_chunk": descriptor})
        odd_reply = http.post(f"{CORTEX}/{job_id}/forward-backward", content=odd, headers=OCTET)
        assert odd_reply.status_code == 400 and odd_reply.json()["field"] == "payload", (
            odd_reply.text
        )
    # The group's frame is invalid (no attention_mask): the request fails with the field named,
    # and the job keeps running.
    replies = post_chunks(http, job_id, "forward-backward", chunks[1:])
    request_id = replies[-1].json()["request_id"]

    def failed() -> dict | None:
        body = http.get(f"{CORTEX}/{job_id}/requests/{request_id}").json()
        if body["status"] == "failed":
            return body
        assert body["status"] in ("pending", "running")
        return None

    body = wait_until(failed, what=f"request {request_id} failed", timeout_s=60)
    assert "attention_mask" in body["error"]
    assert http.get(f"{CORTEX}/{job_id}").json()["status"] == "running"


def test_large_results_arrive_as_result_chunks(http, service, monkeypatch):
    monkeypatch.setattr(async_requests, "INLINE_RESULT_BYTES", 100)
    monkeypatch.setattr(async_requests, "RESULT_CHUNK_BYTES", 560)
    job_id = create(http, job_request("training", "sampling"))
    batch = training_batch(http, service, job_id)
    direct = service.execute(job_id, "forward", {"batch": batch})["batch"]["logprobs"]
    reply = http.post(
        f"{CORTEX}/{job_id}/forward-no-grad", content=wire.dumps({"batch": batch}), headers=OCTET
    ).json()

    def first_page() -> dict | None:  # the first page of events, once the request is done
        first = http.get(
            f"{CORTEX}/{job_id}/requests/{reply['request_id']}", params={"max_events": 2}
        ).json()
        return first if first["status"] == "done" else None

    first = wait_until(first_page, what=f"request {reply['request_id']} done", interval_s=0.01)
    assert first["result"] is None and first["next_cursor"] == "2"
    decoded = wait(http, job_id, reply["request_id"])
    assert torch.equal(decoded["batch"]["logprobs"], direct)


def test_generate_stream_events_drain_by_server_cursor(http, service):
    """Events come in order, each sample's log-probs in the reference's (vLLM's) shape."""
    job_id = create(http, job_request("sampling"))
    params = {"n": 3, "max_tokens": 3, "seed": 1}
    reply = http.post(
        f"{CORTEX}/{job_id}/generate-stream",
        json={"prompts": ["1+1="], "sampling_params": {**params, "logprobs": 2}},
        headers=OCTET,
    ).json()
    assert reply["count"] == 3
    events = []

    def done() -> bool:
        body = http.get(
            f"{CORTEX}/{job_id}/requests/{reply['request_id']}", params={"max_events": 2}
        ).json()
        events.extend(body["events"])
        return bool(events) and events[-1]["type"] == "done"

    wait_until(done, what="the stream's done event", timeout_s=60)
    assert [e["type"] for e in events] == ["result", "result", "result", "done"]
    assert [e["index"] for e in events[:3]] == [0, 1, 2]
    direct = service.resolve(job_id, owner=None, kind="sampling").engine.generate(
        ["1+1="], {**params, "logprobs": 2}
    )
    decode = load_tokenizer(ModelConfig(name=TINY)).decode
    for event, sample in zip(events[:3], direct, strict=True):
        positions = event["output"]["logprobs"]
        assert event["output"]["token_ids"] == sample["token_ids"]
        assert len(positions) == len(sample["logprobs"]) == len(sample["token_ids"])
        for position, flat in zip(positions, sample["logprobs"], strict=True):
            assert position[str(flat["token_id"])]["rank"] == flat["rank"]
            assert position[str(flat["token_id"])]["logprob"] == pytest.approx(flat["logprob"])
            for token, entry in position.items():
                assert set(entry) == {"logprob", "rank", "decoded_token"}
                assert entry["decoded_token"] == decode([int(token)])


def test_control_plane_routes(http):
    job_id = create(http, job_request("training"))
    assert [j["job_id"] for j in http.get(CORTEX).json()["jobs"]] == [job_id]
    assert http.get(CORTEX, params={"status": "cancelled"}).json()["jobs"] == []
    bogus = http.get(CORTEX, params={"status": "bogus"})  # was 200 and no jobs, as if none
    assert bogus.status_code == 400 and bogus.json()["field"] == "status", bogus.text
    capacity = http.get(f"{CORTEX}/capacity").json()
    assert capacity["active_sub_jobs"] == 1 and capacity["has_reservation"] is False
    run = http.get(f"{CORTEX}/{job_id}/experiment-run").json()
    assert run["experiment_run_name"] == job_id
    save = wait(http, job_id, http.post(f"{CORTEX}/{job_id}/save", json={}).json()["request_id"])
    unnamed = http.post(f"{CORTEX}/{job_id}/load", json={})
    assert unnamed.status_code == 400 and unnamed.json()["field"] == "checkpoint_id"
    export = http.post(f"{CORTEX}/{job_id}/checkpoints/{save['checkpoint_id']}:export").json()
    files = {f["filename"]: f for f in export["files"]}
    assert "model.safetensors" in files and "optimizer.pt" in files
    download = httpx.get(files["config.json"]["url"])
    assert download.status_code == 200 and download.json()["model_type"] == "llama"
    forged = files["config.json"]["url"].replace("token=", "token=0")
    assert httpx.get(forged).status_code == 404
    # A link opens the one file it names: another file's name under the same token is a 404.
    other = files["config.json"]["url"].replace("/files/config.json", "/files/optimizer.pt")
    assert httpx.get(other).status_code == 404
    assert http.delete(f"{CORTEX}/{job_id}/checkpoints/{save['checkpoint_id']}").status_code == 204
    assert http.get(f"{CORTEX}/{job_id}/checkpoints").json()["checkpoints"] == []
    assert http.delete(f"{CORTEX}/{job_id}/checkpoints/nope").status_code == 404
    assert http.post(f"{CORTEX}/{job_id}:cancel").json()["status"] == "cancelled"
    assert http.post(f"{CORTEX}/{job_id}:cancel").status_code == 200
    gone = http.post(f"{CORTEX}/{job_id}/step", json={})
    assert gone.status_code == 409 and gone.json()["code"] == "job_cancelled"
    assert http.get(f"{CORTEX}/nosuchjob").status_code == 404
    bad = http.post(CORTEX, json={"sub_job_configs": [], "job_id": "mine"})
    assert bad.status_code == 400 and "job_id" in bad.json()["message"]
    poll = http.get(f"{CORTEX}/{job_id}/requests/nope")
    assert poll.status_code == 404


@pytest.mark.parametrize("max_events", [0, 513])
def test_poll_limits(http, max_events):
    job_id = create(http, job_request("training"))
    request_id = http.post(f"{CORTEX}/{job_id}/step", json={}).json()["request_id"]
    body = http.get(f"{CORTEX}/{job_id}/requests/{request_id}", params={"max_events": max_events})
    assert body.status_code == 400 and "max_events" in body.text
