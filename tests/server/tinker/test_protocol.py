"""The Tinker wire protocol below the SDK: protobuf bodies against the SDK's own codec, op order,
sessions and their heartbeats, auth, and refusals of malformed bodies."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from arctic_platform.server.errors import BadRequest, Conflict
from arctic_platform.server.tinker import codec
from arctic_platform.server.tinker.state import Sequencer
from tests.server.tinker.conftest import ALICE, BOB, TINY, tinker

types = tinker.types
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)


def test_request_decoding_matches_the_sdk_encoder():
    sparse = torch.zeros(3, 4)
    sparse[0, 1], sparse[2, 3] = 0.5, -2.0
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput(
                        chunks=[
                            types.EncodedTextChunk(tokens=[5, 6]),
                            types.EncodedTextChunk(tokens=[7]),
                        ]
                    ),
                    loss_fn_inputs={
                        "target_tokens": [6, 7, 8],
                        "weights": types.TensorData.from_torch_sparse(sparse),
                    },
                )
            ],
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": 0.7, "mode": "x"},
        ),
        model_id="m",
        seq_id=3,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    decoded = codec.decode_forward_backward(message.SerializeToString(), max_data_bytes=1024)
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn) == ("m", 3, "ppo")
    assert decoded.forward_only is True
    assert decoded.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "mode": "x"}
    datum = codec.decode_data(decoded)[0]
    assert datum.tokens.tolist() == [5, 6, 7]
    assert datum.inputs["target_tokens"].tolist() == [6, 7, 8]
    np.testing.assert_array_equal(datum.inputs["weights"], sparse.numpy())


def test_results_decode_with_the_sdk_decoder():
    outputs = [{"logprobs": np.array([-1.0, -2.5], np.float32)}, {"logprobs": np.array([-0.5])}]
    body = codec.encode_forward_backward_output(outputs, {"loss:sum": 4.0})
    result = deserialize_forward_backward_output(body)
    assert result.metrics == {"loss:sum": 4.0}
    assert [o["logprobs"].tolist() for o in result.loss_fn_outputs] == [[-1.0, -2.5], [-0.5]]

    sequences = [
        codec.SampledSequence(tokens=[4, 9], logprobs=[-0.25, -1.5], stop_reason="stop"),
        codec.SampledSequence(tokens=[3], logprobs=[-2.0], stop_reason="length"),
    ]
    sample = deserialize_sample_response(codec.encode_sample_response(sequences, [None, -3.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([4, 9], [-0.25, -1.5], "stop"),
        ([3], [-2.0], "length"),
    ]
    assert sample.prompt_logprobs == [None, -3.0]


def test_malformed_bodies_name_the_field():
    message = forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[
                    types.Datum(
                        model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3]},
                    )
                ],
                loss_fn="cross_entropy",
            ),
            model_id="m",
            seq_id=1,
        )
    )
    message.data[0].loss_fn_inputs["target_tokens"].dense = b"\x01\x02\x03"
    decoded = codec.decode_forward_backward(message.SerializeToString(), max_data_bytes=1024)
    with pytest.raises(BadRequest, match=r"data\[0\]\.loss_fn_inputs\.target_tokens"):
        codec.decode_data(decoded)
    with pytest.raises(BadRequest, match="malformed protobuf"):
        codec.decode_forward_backward(b"\xff\xff\xff", max_data_bytes=1024)


def test_sequencer_starts_in_seq_id_order_and_refuses_reuse():
    started: list[int] = []
    seq = Sequencer()
    seq.admit(3, "r3", lambda: started.append(3))
    seq.admit(2, "r2", lambda: started.append(2))
    assert started == []
    seq.skip(1)  # a refused request frees the ones behind it
    assert started == [2, 3]
    assert seq.known(2) == "r2"
    with pytest.raises(Conflict):
        seq.admit(2, "again", lambda: started.append(-1))
    seq.admit(4, "r4", lambda: started.append(4))
    assert started == [2, 3, 4]
    # The refused request's seq_id has no request: its reuse is a 400 naming it (the SDK
    # retries a 409), not a request id of nothing.
    with pytest.raises(BadRequest, match="seq_id: 1 was used by a request this server refused"):
        seq.known(1)


def test_sequencer_bounds_how_far_ahead_and_how_far_back_it_remembers(monkeypatch):
    """A ``seq_id`` the window or more ahead of the next is a 400 naming it (a refused one is
    not parked), and request ids more than the window behind are forgotten: each is held in
    memory, so a client numbering its requests wildly cannot grow the server without end."""
    from arctic_platform.server.tinker import state

    monkeypatch.setattr(state, "SEQ_ID_WINDOW", 4)
    seq = Sequencer()
    with pytest.raises(BadRequest, match="seq_id: 5 is 4 or more ahead"):
        seq.check_window(5)
    with pytest.raises(BadRequest, match="seq_id"):
        seq.admit(5, "r5", lambda: None)
    seq.skip(1_000_000)  # refused, far ahead: nothing parked
    assert not seq.parked
    for seq_id in range(1, 11):
        seq.admit(seq_id, f"r{seq_id}", lambda: None)
    assert [seq.known(i) for i in (6, 7, 10)] == [None, "r7", "r10"]
    seq.check_window(14)  # the window moved with the next seq_id


def test_a_finished_session_cancels_a_job_made_while_it_finished():
    """Creating a job for a session takes a while; a finish meanwhile may not see the job, so
    holding it in a finished session cancels it at once and answers 410."""
    from arctic_platform.server.tinker.state import Session, SessionGone

    session, cancelled = Session("s1", "alice"), []
    session.hold("job-1", cancelled.append)
    assert cancelled == [] and session.job_ids == ["job-1"]
    session.finished = True
    with pytest.raises(SessionGone):
        session.hold("job-2", cancelled.append)
    assert cancelled == ["job-2"]


def test_a_tenant_keeps_its_most_recently_used_samplers(monkeypatch, tmp_path):
    from arctic_platform.server.errors import NotFound
    from arctic_platform.server.store import MetadataStore
    from arctic_platform.server.tinker import state

    monkeypatch.setattr(state, "MAX_SAMPLERS_PER_TENANT", 2)
    tinker_state = state.TinkerState(MetadataStore(tmp_path / "metadata.sqlite3"))

    def add(sampler_id: str, owner: str) -> None:
        tinker_state.add_sampler(state.Sampler(sampler_id, owner, "s", "builtin:tiny"))

    add("a1", "alice")
    add("a2", "alice")
    add("b1", "bob")
    tinker_state.sampler("a1", "alice")  # used: a2 is now the least recently used
    add("a3", "alice")
    with pytest.raises(NotFound, match="2 most recently used"):
        tinker_state.sampler("a2", "alice")
    assert tinker_state.sampler("a1", "alice").sampler_id == "a1"
    assert tinker_state.sampler("b1", "bob").owner == "bob"
    with pytest.raises(NotFound):
        tinker_state.sampler("a1", "bob")  # another tenant's id is not found


def test_finished_futures_past_the_limit_drop_the_first_finished(monkeypatch):
    import asyncio
    import json
    from concurrent.futures import Future

    from arctic_platform.server.errors import NotFound
    from arctic_platform.server.tinker import futures

    def done(i: int) -> Future:
        future: Future = Future()
        future.set_result(futures.OpResult(json={"i": i}))
        return future

    def retrieved(request_id: str) -> dict:
        return json.loads(asyncio.run(store.retrieve(request_id, "alice")).body)

    monkeypatch.setattr(futures, "MAX_FINISHED", 2)
    store = futures.FutureStore()
    running: Future = Future()
    late = store.add("alice", running)
    first, second, third = (store.add("alice", done(i)) for i in (1, 2, 3))
    with pytest.raises(NotFound):
        retrieved(first)
    assert retrieved(third) == {"i": 3}
    running.set_result(futures.OpResult(json={"i": 0}))  # finishes last: second goes
    assert retrieved(late) == {"i": 0}
    with pytest.raises(NotFound):
        retrieved(second)
    with pytest.raises(NotFound):  # another owner's request id is unknown to bob
        asyncio.run(store.retrieve(late, "bob"))


def test_sessions_heartbeat_finish_and_auth(server_url):
    alice = {"X-API-Key": ALICE}
    with httpx.Client(base_url=server_url + "/api/v1", timeout=30) as http:
        assert http.post("/client/config", json={}).status_code == 401
        wrong = http.post("/client/config", json={}, headers={"X-API-Key": "tml-x"})
        assert wrong.status_code == 401
        config = http.post("/client/config", json={"sdk_version": "0.38.0"}, headers=alice)
        assert config.json()["pjwt_auth_enabled"] is False
        session = http.post("/create_session", json={}, headers=alice).json()["session_id"]
        beat = http.post("/session_heartbeat", json={"session_id": session}, headers=alice)
        assert beat.json() == {"type": "session_heartbeat"}
        stranger = {"X-API-Key": BOB}
        assert (
            http.post("/session_heartbeat", json={"session_id": session}, headers=stranger)
        ).status_code == 404
        sampler = http.post(
            "/create_sampling_session",
            json={"session_id": session, "sampling_session_seq_id": 0, "base_model": TINY},
            headers=alice,
        ).json()["sampling_session_id"]
        assert http.get(f"/samplers/{sampler}", headers=alice).json()["base_model"] == TINY
        finish = http.post(
            f"/sessions/{session}/finish", json={"reason": {"type": "success"}}, headers=alice
        )
        assert finish.status_code == 204
        gone = http.post("/session_heartbeat", json={"session_id": session}, headers=alice)
        assert gone.status_code == 410
        refused = http.post(
            "/create_model",
            json={"session_id": session, "model_seq_id": 0, "base_model": TINY},
            headers=alice,
        )
        assert refused.status_code == 410
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
        late_sample = http.post(  # its model's job was freed with the session: not restarted
            "/asample",
            json={"sampling_session_id": sampler, "prompt": prompt, "sampling_params": {}},
            headers=alice,
        )
        assert late_sample.status_code == 410
        missing = http.post("/retrieve_future", json={"request_id": "nope"}, headers=alice)
        assert missing.status_code == 404
        bad = http.post(
            "/forward_backward",
            content=b"\xff\xff",
            headers={**alice, "Content-Type": "application/x-protobuf"},
        )
        assert bad.status_code == 400 and "malformed protobuf" in bad.json()["message"]
