"""The ``tokenize`` op (the worked example of adding an op, docs/architecture.md): the sampling
model's token ids through every surface, its limits, and its refusals.

One Service on the built-in tiny model serves the results (the ids must equal the model folder's
own ``AutoTokenizer``'s); one on FakeEngine, whose sampler holds no tokenizer (as the Ray replica),
serves the refusals. Each is one module-scoped job behind one app on 127.0.0.1, reached as the
in-process, on-prem HTTP and Cortex clients reach it.
"""

from __future__ import annotations

import re

import httpx
import pytest

from arctic_platform.client import InvalidRequestError, create_arctic_rl_client
from arctic_platform.contract.ops import OpName
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from tests.client.conftest import backend_config
from tests.fake_engine import build_fake_engine
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, TINY, job_request, make_app

SURFACES = ("inprocess", "http", "cortex")
TEXTS = ["Hello, world!", "", "a b  c\n", "x" * 40]
# Small enough for a request of 9 texts or a 2049-byte text to cross them.
LIMITS = ServerLimits(max_batch_rows=8, max_batch_tokens=4 * 2048)


def _served(tmp_path_factory, name: str, **options):
    """A Service with one running sampling job, its app at a URL: ``(service, url, sub-job)``."""
    service = Service(
        ServiceSettings(data_dir=tmp_path_factory.mktemp(name), device="cpu", limits=LIMITS),
        **options,
    )
    info = service.create_job(job_request("sampling"))
    service.wait_until_running(info["job_id"], timeout=120)
    return service, info["sub_jobs"][0]["sub_job_id"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    service, sub_job = _served(tmp_path_factory, "tiny")
    try:
        with serve_app(make_app(service)) as url:
            yield service, url, sub_job
    finally:
        service.close()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    service, sub_job = _served(tmp_path_factory, "fake", engine_builder=build_fake_engine)
    try:
        with serve_app(make_app(service)) as url:
            yield service, url, sub_job
    finally:
        service.close()


def _client(kind: str, served, tmp_path):
    """A blocking client of ``kind`` attached to the served sampling job."""
    service, url, sub_job = served
    config = {
        "model": TINY,
        "backend": backend_config(kind, url, tmp_path),
        "sampling_job_id": sub_job,
    }
    options = {"server_state": service} if kind == "inprocess" else {}
    return create_arctic_rl_client(config, blocking_calls=True, **options)


def _expected(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The ids of the model folder's own tokenizer (what a user would load beside the client)."""
    from transformers import AutoTokenizer

    from arctic_platform.engine.builtin import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TINY))
    return [tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"] for t in texts]


@pytest.mark.parametrize("kind", SURFACES)
def test_the_ids_are_the_model_tokenizers_on_every_surface(kind, tiny, tmp_path):
    with _client(kind, tiny, tmp_path) as client:
        for special in (False, True):
            assert client.tokenize(TEXTS, add_special_tokens=special) == _expected(TEXTS, special)


@pytest.mark.parametrize("kind", SURFACES)
def test_the_async_client_tokenizes_alike(kind, tiny, tmp_path):
    import asyncio

    service, url, sub_job = tiny
    config = {
        "model": TINY,
        "backend": backend_config(kind, url, tmp_path),
        "sampling_job_id": sub_job,
    }
    options = {"server_state": service} if kind == "inprocess" else {}

    async def tokenize():
        client = create_arctic_rl_client(config, **options)
        async with client:
            return await client.tokenize(TEXTS)

    assert asyncio.run(tokenize()) == _expected(TEXTS, False)


@pytest.mark.parametrize(
    ("texts", "error", "field"),
    [
        ("one text", TypeError, "texts"),
        (["ok", 3], TypeError, "texts[1]"),
        ([], ValueError, "texts"),
    ],
)
def test_the_client_refuses_bad_texts_before_sending(texts, error, field, tiny, tmp_path):
    with _client("inprocess", tiny, tmp_path) as client:
        with pytest.raises(error, match="^tokenize: " + re.escape(field) + " "):
            client.tokenize(texts)
        with pytest.raises(TypeError, match="add_special_tokens"):
            client.tokenize(["a"], add_special_tokens="yes")


# Bodies a client of ours would not send, each with the field the 400 must name.
BAD_BODIES = [
    ({"texts": "one text"}, "texts must be a list of strings"),
    ({"texts": ["ok", 3]}, "texts[1] must be a string"),
    ({"texts": ["ok"], "add_special_tokens": "maybe"}, "add_special_tokens"),
    ({"texts": ["ok"], "special": True}, "special"),
    ({"texts": []}, "texts is empty"),
    ({}, "texts"),
]


def _status_and_message(surface: str, served, body) -> tuple[int, str]:
    """Send ``body`` as a tokenize on ``surface`` without our client's checks."""
    service, url, sub_job = served
    if surface == "inprocess":
        from arctic_platform.server.errors import ServiceError

        try:
            service.execute(sub_job, OpName.TOKENIZE, body)
        except ServiceError as exc:
            return exc.status, exc.message
        return 200, ""
    with httpx.Client(base_url=url, timeout=60) as http:
        if surface == "http":
            reply = http.post("/tokenize", params={"job_id": sub_job}, json=body)
        else:
            reply = http.post(f"{CORTEX}/{sub_job.split(':')[0]}/tokenize", json=body)
    return reply.status_code, reply.json().get("message", "")


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(("body", "names"), BAD_BODIES)
def test_a_bad_body_is_a_400_naming_the_field(surface, body, names, fake):
    status, message = _status_and_message(surface, fake, body)
    assert status == 400, message
    assert message.startswith("tokenize: ") and names in message


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(
    ("texts", "limit"), [(["a"] * 9, "max_batch_rows"), (["x" * 2049] * 4, "max_batch_tokens")]
)
def test_a_request_over_the_limits_is_refused_before_it_runs(surface, texts, limit, fake):
    status, message = _status_and_message(surface, fake, {"texts": texts})
    assert status == 413, message
    assert message.startswith("tokenize: ") and "limit" in message


@pytest.mark.parametrize("kind", SURFACES)
def test_add_special_tokens_reaches_the_tokenizer(kind, fake, tmp_path, monkeypatch):
    """The built-in tokenizer adds no special tokens, so whether the flag travels is seen on a
    tokenizer that records its calls (in the fake sampler, which has none of its own)."""
    service, _, sub_job = fake
    calls = []

    def tokenizer(texts, *, add_special_tokens):
        calls.append((list(texts), add_special_tokens))
        return {"input_ids": [[len(t)] for t in texts]}

    monkeypatch.setattr(service.resolve(sub_job, owner=None).engine, "tokenizer", tokenizer)
    with _client(kind, fake, tmp_path) as client:
        assert client.tokenize(["ab", "c"], add_special_tokens=True) == [[2], [1]]
        assert client.tokenize(["ab"]) == [[2]]
    assert calls == [(["ab", "c"], True), (["ab"], False)]


@pytest.mark.parametrize("kind", SURFACES)
def test_an_engine_without_a_tokenizer_is_a_400_saying_why(kind, fake, tmp_path):
    """FakeEngine's sampler, like the Ray replica (whose model lives in an actor), holds no
    tokenizer in the server: a clear 400, not a 500, and the job keeps running."""
    service, _, sub_job = fake
    with _client(kind, fake, tmp_path) as client:
        with pytest.raises(InvalidRequestError, match="holds no tokenizer") as caught:
            client.tokenize(["a"])
        assert caught.value.status == 400
        assert caught.value.code == "unsupported_op"
    assert service.get_job(sub_job.split(":")[0])["status"] == "running"
