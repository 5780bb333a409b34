"""Hostile Tinker bodies, sent raw (the SDK refuses to build them) to the real routes of a server
in this process: tensors whose declared shape is huge, negative, overflowing or at odds with their
datum, and samples and batches beyond the server's work limits. Each is refused, with a 400 naming
the field or a 413 ``limit_exceeded`` naming the limit and its flag, before anything of the
declared size is allocated (the process's peak RSS says so), and the training run goes on with
its weights untouched.

The module's server has the default limits but for ``max_sample_tokens``, set low enough that a
sample without ``max_tokens`` exceeds it through the model's context alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest

from arctic_platform.engine.builtin import BUILTIN_MODELS
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.tinker import bodies, proto
from tests.server.helpers import peak_growth_mib
from tests.server.tinker.conftest import ALICE, BOB, TINY

response_conv = pytest.importorskip("tinker.proto.response_conv")

CONTEXT = BUILTIN_MODELS[TINY.removeprefix("builtin:")].max_position_embeddings
LIMITS = ServerLimits(max_sample_tokens=64 * CONTEXT)
PROTOBUF = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def server_app(tmp_path_factory):
    data = tmp_path_factory.mktemp("tinker-hostile")
    service = Service(ServiceSettings(data_dir=data, device="cpu", limits=LIMITS))
    return create_app(service, auth=TokenAuth([ALICE, BOB]))


@pytest.fixture(scope="module")
def http(server_url):
    with httpx.Client(
        base_url=server_url + "/api/v1", headers={"X-API-Key": ALICE}, timeout=60
    ) as client:
        yield client


def result_of(http: httpx.Client, answer: httpx.Response) -> httpx.Response:
    """The ``retrieve_future`` answer of an op that answered ``{request_id}``."""
    assert answer.status_code == 200, answer.text
    request_id = answer.json()["request_id"]
    for _ in range(10):  # each poll waits up to 30 s for the op
        got = http.post("/retrieve_future", json={"request_id": request_id})
        if got.status_code != 408:
            assert got.status_code == 200, got.text
            return got
    raise AssertionError(f"request {request_id} did not finish")


@dataclass
class Run:
    """A training run driven with raw bodies: its model id, the next ``seq_id``, and the
    log-probs its untouched weights give the valid datum."""

    model_id: str
    seq: itertools.count = field(default_factory=lambda: itertools.count(1))
    before: list[float] | None = None


@pytest.fixture(scope="module")
def run(http) -> Run:
    session = http.post("/create_session", json={}).json()["session_id"]
    created = http.post(
        "/create_model",
        json={
            "session_id": session,
            "model_seq_id": 0,
            "base_model": TINY,
            "lora_config": {"rank": 4, "seed": 3},
        },
    )
    run = Run(result_of(http, created).json()["model_id"])
    run.before = forward(http, run)
    return run


def dense(values, dtype=np.float32, shape=None):
    values = np.asarray(values, dtype=dtype)
    return proto.Tensor(
        dense=values.tobytes(),
        dtype=proto.DTYPE_FLOAT32 if dtype == np.float32 else proto.DTYPE_INT64,
        shape=list(values.shape) if shape is None else shape,
    )


def sparse(shape, crow, cols, values):
    tensor = proto.Tensor(dtype=proto.DTYPE_FLOAT32, shape=shape)
    tensor.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.asarray(cols, np.int64).tobytes()
    tensor.sparse_csr.values = np.asarray(values, np.float32).tobytes()
    return tensor


def one_per_page(shape, count: int):
    """A sparse float32 ``shape`` with ``count`` ones, one per 4 KiB page of its dense form: what
    a dense decode would have to touch."""
    rows, width = shape
    flat = np.arange(count, dtype=np.int64) * 1024
    row_of, cols = flat // width, flat % width
    crow = np.searchsorted(row_of, np.arange(rows + 1))
    return sparse(shape, crow, cols, np.ones(count))


def datum(tokens=(5, 6, 7), **inputs):
    """``(tokens, loss inputs)``: a cross-entropy datum (targets the next ids, the first one
    weighted 0) unless ``inputs`` replace its tensors."""
    n = len(tokens)
    valid = {
        "target_tokens": dense([t + 1 for t in tokens], np.int64),
        "weights": dense([0.0] + [1.0] * (n - 1)),
    }
    return list(tokens), {**valid, **inputs}


def fwd_bwd(http, run: Run, data, *, forward_only=False) -> httpx.Response:
    message = proto.ForwardBackwardRequest(
        model_id=run.model_id,
        seq_id=next(run.seq),
        loss_fn="cross_entropy",
        forward_only=forward_only,
    )
    for tokens, inputs in data:
        item = message.data.add()
        item.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
        for name, tensor in inputs.items():
            item.loss_fn_inputs[name].CopyFrom(tensor)
    return http.post("/forward_backward", content=message.SerializeToString(), headers=PROTOBUF)


def forward(http, run: Run) -> list[float]:
    """The valid datum's target log-probs under the run's weights now (a valid op runs)."""
    answer = result_of(http, fwd_bwd(http, run, [datum()], forward_only=True))
    output = response_conv.deserialize_forward_backward_output(answer.content)
    return output.loss_fn_outputs[0]["logprobs"].tolist()


def assert_refused(answer: httpx.Response, status: int, field_name: str) -> dict:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert field_name in body["message"], body
    if status == 400:  # bad input names its field; a 413 names its limit instead
        assert body.get("field") == field_name, body
    return body


def test_a_small_sparse_body_declaring_gigabytes_is_refused_before_it_is_allocated(http, run):
    # 8 GiB dense from 1.2 MB of body: a datum of one token whose weights are [1, 2**31].
    declared = 2**31 * 4
    huge = datum([5], weights=one_per_page([1, 2**31], 100_000))
    answer, grew = peak_growth_mib(lambda: fwd_bwd(http, run, [huge]))
    assert grew < 100, f"peak RSS rose {grew:.0f} MiB for a request declaring 8 GiB"
    body = assert_refused(answer, 413, "data[0].loss_fn_inputs.weights")
    assert body["code"] == "limit_exceeded" and body["limit"] == "max_body_mb"
    assert "--max-body-mb" in body["message"] and body["value"] >= declared
    # rows that disagree with the datum: 16 GiB declared for a datum of three tokens
    wide = datum(weights=one_per_page([4096, 2**20], 100_000))
    answer, grew = peak_growth_mib(lambda: fwd_bwd(http, run, [wide]))
    assert grew < 100, f"peak RSS rose {grew:.0f} MiB for a request declaring 16 GiB"
    assert_refused(answer, 400, "data[0].loss_fn_inputs.weights")
    assert "[3] or [3, K]" in answer.json()["message"]
    assert forward(http, run) == run.before


@pytest.mark.parametrize(
    ("name", "tensor", "says"),
    [
        ("target_tokens", dense([], np.int64, [2**32, 2**32]), "does not fit its datum"),
        ("target_tokens", dense([], np.int64, [3, 2**62]), "do not fill shape"),
        ("weights", dense([1.0], shape=[-1, -1]), "negative dimension"),
        ("weights", dense([1.0] * 3, shape=[3] + [1] * 99), "does not fit its datum"),
        ("weights", dense([1.0] * 3, shape=[]), "does not fit its datum"),
        ("weights", sparse([-1, 5], [0], [], []), "negative dimension"),
        ("weights", sparse([1, 2**40], [0, 1], [2**40 - 1], [1.0]), "does not fit its datum"),
        ("weights", sparse([3], [0, 0, 0, 0], [], []), "needs a 2-D shape"),
        ("weights", sparse([3, 2], [0, 1, 1, 5], [0], [1.0]), "inconsistent sparse CSR"),
    ],
)
def test_malformed_shapes_are_a_400_naming_the_field(http, run, name, tensor, says):
    answer, grew = peak_growth_mib(lambda: fwd_bwd(http, run, [datum(**{name: tensor})]))
    assert_refused(answer, 400, f"data[0].loss_fn_inputs.{name}")
    assert says in answer.json()["message"]
    assert grew < 100


def test_a_sparse_row_wider_than_the_body_limit_is_a_413(http, run):
    answer, grew = peak_growth_mib(
        lambda: fwd_bwd(http, run, [datum([5], weights=sparse([1, 2**40], [0, 1], [7], [1.0]))])
    )
    body = assert_refused(answer, 413, "data[0].loss_fn_inputs.weights")
    assert body["limit"] == "max_body_mb" and grew < 100


@pytest.mark.slow  # 12 k datums built and decoded
def test_batches_beyond_the_default_limits_are_413s_naming_limit_and_flag(http, run):
    one_token = datum([5])
    rows = fwd_bwd(http, run, [one_token] * (LIMITS.max_batch_rows + 1))
    body = assert_refused(rows, 413, "--max-batch-rows")
    assert (body["code"], body["limit"]) == ("limit_exceeded", "max_batch_rows")
    # 4096 short rows padded to the width of a long one: rows x width over max_batch_tokens
    width = LIMITS.max_batch_tokens // (LIMITS.max_batch_rows // 2)
    long_one = datum([5 + i % 50 for i in range(width - 1)])
    tokens = fwd_bwd(http, run, [long_one] + [one_token] * (LIMITS.max_batch_rows // 2))
    body = assert_refused(tokens, 413, "--max-batch-tokens")
    assert body["limit"] == "max_batch_tokens" and body["value"] > LIMITS.max_batch_tokens
    assert forward(http, run) == run.before


def test_an_infinite_learning_rate_is_refused_and_the_weights_stay(http, run):
    answer = http.post(
        "/optim_step",
        content=b'{"model_id": "%s", "seq_id": %d, "adam_params": {"learning_rate": 1e999}}'
        % (run.model_id.encode(), next(run.seq)),
        headers={"Content-Type": "application/json"},
    )
    assert_refused(answer, 400, "adam_params.learning_rate")
    assert forward(http, run) == run.before


def first_answer(http: httpx.Client, answer: httpx.Response) -> httpx.Response:
    """The op's ``retrieve_future`` answer, failing (not waiting on) an op parked behind a
    ``seq_id`` that never comes: the server holds one poll up to 30 s for the op."""
    assert answer.status_code == 200, answer.text
    got = http.post("/retrieve_future", json={"request_id": answer.json()["request_id"]})
    assert got.status_code == 200, f"the op did not run (parked behind a lost seq_id?): {got.text}"
    return got


def test_another_tenants_future_is_not_found(http, run):
    """Bob holding Alice's request id learns nothing from it: the same 404 as an unknown id,
    and Alice still gets her result."""
    request_id = fwd_bwd(http, run, [datum()], forward_only=True).json()["request_id"]
    stolen = http.post(
        "/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": BOB}
    )
    unknown = http.post("/retrieve_future", json={"request_id": "0" * 32})
    assert stolen.status_code == unknown.status_code == 404
    assert stolen.json()["message"] == unknown.json()["message"].replace("0" * 32, request_id)
    answer = first_answer(http, httpx.Response(200, json={"request_id": request_id}))
    output = response_conv.deserialize_forward_backward_output(answer.content)
    assert output.loss_fn_outputs[0]["logprobs"].tolist() == run.before


@pytest.mark.parametrize(
    ("route", "body", "field_name"),
    [
        ("optim_step", {"adam_params": {"learning_rate": "fast"}}, "adam_params.learning_rate"),
        ("save_weights", {"path": 7}, "path"),
        ("save_weights_for_sampler", {"ttl_seconds": "soon"}, "ttl_seconds"),
        ("load_weights", {"optimizer": "yes"}, "path"),
    ],
)
def test_a_json_op_refused_while_parsing_uses_up_its_seq_id(http, run, route, body, field_name):
    refused = http.post(
        f"/{route}", json={"model_id": run.model_id, "seq_id": next(run.seq), **body}
    )
    assert_refused(refused, 400, field_name)
    # The client's next request (the next seq_id) runs instead of waiting on the refused one.
    answer = first_answer(http, fwd_bwd(http, run, [datum()], forward_only=True))
    output = response_conv.deserialize_forward_backward_output(answer.content)
    assert output.loss_fn_outputs[0]["logprobs"].tolist() == run.before


@pytest.mark.parametrize("seq_id", [0, -3])
def test_a_protobuf_seq_id_below_one_is_a_400_naming_it(http, run, seq_id):
    # The SDK numbers requests from 1 and sends 0 only for a caller's missing seq_id.
    message = proto.ForwardBackwardRequest(
        model_id=run.model_id, seq_id=seq_id, loss_fn="cross_entropy"
    )
    tokens, inputs = datum()
    item = message.data.add()
    item.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    for name, tensor in inputs.items():
        item.loss_fn_inputs[name].CopyFrom(tensor)
    answer = http.post("/forward_backward", content=message.SerializeToString(), headers=PROTOBUF)
    assert_refused(answer, 400, "seq_id")
    assert forward(http, run) == run.before  # and the client's own numbering goes on


@pytest.mark.parametrize(
    ("lora", "field_name"),
    [
        ({"rank": bodies.MAX_LORA_RANK + 1}, "lora_config.rank"),
        ({"rank": 2**31}, "lora_config.rank"),
        ({"rank": 0}, "lora_config.rank"),
        ({"rank": 4, "seed": 2**70}, "lora_config.seed"),  # the job failed once built
    ],
)
def test_a_lora_config_out_of_bounds_is_a_400_naming_it_and_starts_nothing(
    http, server_app, lora, field_name
):
    service, alice = server_app.state.service, server_app.state.auth.owner(f"Bearer {ALICE}")
    session = http.post("/create_session", json={}).json()["session_id"]
    jobs = len(service.list_jobs(owner=alice))
    answer = http.post(
        "/create_model",
        json={
            "session_id": session,
            "model_seq_id": 0,
            "base_model": TINY,
            "lora_config": lora,
        },
    )
    assert_refused(answer, 400, field_name)
    assert len(service.list_jobs(owner=alice)) == jobs


@pytest.fixture(scope="module")
def sampler(http, run) -> str:
    session = http.post("/create_session", json={}).json()["session_id"]
    return http.post(
        "/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 0, "base_model": TINY},
    ).json()["sampling_session_id"]


def asample(http, sampler: str, num_samples: int, max_tokens: int) -> httpx.Response:
    return http.post(
        "/asample",
        json={
            "sampling_session_id": sampler,
            "num_samples": num_samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": max_tokens, "seed": 1},
        },
    )


@pytest.mark.parametrize(
    ("num_samples", "max_tokens", "limit"),
    [
        (2_000_000, 1, "max_samples_per_request"),
        (LIMITS.max_samples_per_request, 2048, "max_sample_tokens"),
    ],
)
def test_asample_beyond_the_default_limits_is_a_413(http, sampler, num_samples, max_tokens, limit):
    answer, grew = peak_growth_mib(lambda: asample(http, sampler, num_samples, max_tokens))
    body = assert_refused(answer, 413, "--" + limit.replace("_", "-"))
    assert (body["code"], body["limit"]) == ("limit_exceeded", limit)
    assert grew < 100
    sampled = response_conv.deserialize_sample_response(
        result_of(http, asample(http, sampler, 2, 3)).content
    )
    assert len(sampled.sequences) == 2 and all(1 <= len(s.tokens) <= 3 for s in sampled.sequences)


def test_asample_without_max_tokens_counts_the_loaded_engines_context(http, sampler):
    result_of(http, asample(http, sampler, 1, 1))  # the sampler's engine is loaded
    answer = http.post(
        "/asample",
        json={
            "sampling_session_id": sampler,
            "num_samples": 65,  # 65 x the context: one sample over max_sample_tokens
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {},
        },
    )
    body = assert_refused(answer, 413, "--max-sample-tokens")
    assert body["value"] == 65 * CONTEXT


@pytest.mark.parametrize(
    ("route", "body", "field_name"),
    [
        ("session_heartbeat", '{"session_id": "\\ud800"}', "session_id"),
        ("create_model", '{"session_id": "\\udc00", "model_seq_id": 0}', "session_id"),
        ("weights_info", '{"tinker_path": "tinker://\\ud800/weights/x"}', "tinker_path"),
        ("create_sampling_session", '{"model_path": "tinker://\\ud9ff/x"}', "model_path"),
    ],
)
def test_a_lone_surrogate_escape_is_a_400_naming_its_field(http, route, body, field_name):
    """JSON's ``\\ud800`` alone decodes to a string no store or file can hold: it reached SQLite
    and was a 500 on each of these routes; now it is refused where the body is parsed."""
    answer = http.post(f"/{route}", content=body, headers={"content-type": "application/json"})
    assert_refused(answer, 400, field_name)
    assert "lone UTF-16 surrogate" in answer.json()["message"]


@pytest.mark.parametrize(
    ("bad", "field_name"),
    [
        (datum(tokens=(5, 6, 10_000)), "data[1].model_input"),
        (
            datum(target_tokens=dense([6, 7, 10_000], np.int64)),
            "data[1].loss_fn_inputs.target_tokens",
        ),
        (datum(target_tokens=dense([6, -1, 8], np.int64)), "data[1].loss_fn_inputs.target_tokens"),
    ],
)
def test_a_token_outside_the_vocabulary_is_a_400_naming_its_datum(http, run, bad, field_name):
    """At submit, naming the datum and its field (the engine named only ``batch.input_ids``,
    the batch built of every datum, in the future's error); nothing ran."""
    assert_refused(fwd_bwd(http, run, [datum(), bad]), 400, field_name)
    assert forward(http, run) == run.before
