"""The OpenAI-compatible API, driven by the official ``openai`` SDK (sync and async, streamed and
not) against the real server: uvicorn on 127.0.0.1, the real app, two tenants' tokens, the
built-in tiny model.

One module-wide server and one training run (a GRPO step, a checkpoint with HF weights) serve
every case; the expected answers are our own client's ``generate`` with the same seeds."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.engine.builtin import builtin_model_path
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import TINY, make_app
from tests.server.helpers import SAMPLING, grpo_batch

ALICE, BOB = "oai-alice-token", "oai-bob-token"
BOB_OWNER = TokenAuth([BOB]).owner(f"Bearer {BOB}")
MAX_SAMPLES = 64
PROMPTS = ["1+2=", "3+"]
PARAMS = {"n": 2, "max_tokens": 5, "seed": 11, "temperature": 1.0, "logprobs": 2}
MESSAGES = [{"role": "user", "content": "What is 1+2?"}]
CHAT_PARAMS = {"n": 1, "max_tokens": 6, "seed": 5, "temperature": 0.8}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    settings = ServiceSettings(
        data_dir=tmp_path_factory.mktemp("oai") / "data",
        device="cpu",
        limits=ServerLimits(max_samples_per_request=MAX_SAMPLES),
    )
    svc = Service(settings)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def server(service):
    with serve_app(make_app(service, tokens=[ALICE, BOB])) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(builtin_model_path(TINY))


@pytest.fixture(scope="module")
def run(server, tokenizer):
    """Alice's training run over our client (http backend): what its sampler generates on the
    base weights, one GRPO step, a checkpoint with HF weights, what it generates after the
    trained weights were synced to it."""
    os.environ["OAI_TEST_ALICE"] = ALICE
    config = {
        "model": TINY,
        "seed": 0,
        "backend": {"type": "http", "url": server, "token_env": "OAI_TEST_ALICE"},
        "training": {"optimizer": {"name": "AdamW", "lr": 5e-2}},
        "sampling": {},
    }
    client = create_arctic_rl_client(config, blocking_calls=True)
    base = client.generate(PROMPTS, PARAMS)
    chat_prompt = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    base_chat = client.generate([chat_prompt], CHAT_PARAMS)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("1+2=", "3+4=")]
    results = client.generate(prompt_ids, SAMPLING)
    batch = grpo_batch(prompt_ids, results, SAMPLING["n"])
    client.fwd_bwd({"batch": batch, "processing": {"loss_fn": "verl_grpo"}})
    client.step()
    saved = client.save_checkpoint(export_hf=True)
    client.sync_weights()
    trained = client.generate(PROMPTS, PARAMS)
    job_id = client.training_job_id.split(":")[0]
    yield SimpleNamespace(
        base=base,
        base_chat=base_chat,
        trained=trained,
        checkpoint=f"job:{job_id}/{saved['checkpoint_id']}",
        job_id=job_id,
    )
    client.close()
    del os.environ["OAI_TEST_ALICE"]


def sdk(url: str, key: str = ALICE, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + prefix, api_key=key, max_retries=0, timeout=300)


def async_sdk(url: str, key: str = ALICE, prefix: str = "/v1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + prefix, api_key=key, max_retries=0, timeout=300)


def assert_same_samples(choices, ours: list[dict]) -> None:
    """OpenAI choices carry exactly our samples: text, tokens' log-probs, finish reasons."""
    assert len(choices) == len(ours)
    for choice, sample in zip(choices, ours, strict=True):
        assert choice.text == sample["text"]
        assert choice.finish_reason == sample["finish_reason"]
        assert choice.logprobs.token_logprobs == [e["logprob"] for e in sample["logprobs"]]
        assert len(choice.logprobs.tokens) == len(sample["token_ids"])


def test_completions_on_a_base_model_equal_our_generate(server, run):
    answer = sdk(server).completions.create(model=TINY, prompt=PROMPTS, **_openai(PARAMS))
    assert_same_samples(answer.choices, run.base)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.model == TINY
    assert answer.usage.prompt_tokens == sum(len(p) for p in PROMPTS)  # one token per character
    assert answer.usage.completion_tokens == sum(len(s["token_ids"]) for s in run.base)
    for choice in answer.choices:  # top-2 alternatives, and the chosen token
        assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)


def test_completions_on_a_checkpoint_equal_the_run_s_sampler_async(server, run):
    """The checkpoint (saved during the run) by job id, through Tinker's prefix, async SDK."""

    async def ask():
        async with async_sdk(server, prefix="/oai/api/v1") as client:
            return await client.completions.create(
                model=run.checkpoint, prompt=PROMPTS, **_openai(PARAMS)
            )

    answer = asyncio.run(ask())
    assert_same_samples(answer.choices, run.trained)
    latest = sdk(server).completions.create(
        model=f"job:{run.job_id}", prompt=PROMPTS, **_openai(PARAMS)
    )
    assert_same_samples(latest.choices, run.trained)  # the job's latest checkpoint is that one
    assert [s["text"] for s in run.trained] != [s["text"] for s in run.base]  # it did train


def test_token_id_prompts_and_streaming_give_the_same_completions(server, run):
    ids = [[ord(c) - ord(" ") + 10 for c in p] for p in PROMPTS]  # not our tokenizer's ids
    client = sdk(server)
    by_ids = client.completions.create(model=TINY, prompt=ids, max_tokens=4, seed=3)
    streamed = client.completions.create(
        model=TINY,
        prompt=ids,
        max_tokens=4,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    texts = {c.choices[0].index: c.choices[0].text for c in chunks if c.choices}
    assert texts == {c.index: c.text for c in by_ids.choices}
    assert chunks[-1].usage.completion_tokens == by_ids.usage.completion_tokens
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)


def test_the_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": TINY, "prompt": "1+", "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", server + "/v1/completions", json=body, headers={"X-API-Key": BOB}, timeout=300
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["object"] == "text_completion" and first["choices"][0]["index"] == 0


def test_usage_reports_the_prompt_tokens_the_cache_provided(server):
    prompt = "12+34=46, 56+78=134, 90+12=102, 34+56="  # a prompt no other test sends
    params = {"max_tokens": 2, "seed": 3, "temperature": 1.0}
    first, again = (
        sdk(server).completions.create(model=TINY, prompt=prompt, **params) for _ in range(2)
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt)  # a whole hit


def test_chat_on_a_base_model_is_our_generate_on_the_chat_template(server, run):
    answer = sdk(server).chat.completions.create(
        model=TINY, messages=MESSAGES, logprobs=True, top_logprobs=1, **_openai(CHAT_PARAMS)
    )
    (ours,) = run.base_chat
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ours["text"]
    assert len(choice.logprobs.content) == len(ours["token_ids"])
    assert all(len(t.top_logprobs) == 1 for t in choice.logprobs.content)
    assert answer.usage.prompt_tokens == ours["prompt_len"]


def test_chat_streams_sync_and_async(server, run):
    (ours,) = run.base_chat
    chunks = list(
        sdk(server).chat.completions.create(
            model=TINY, messages=MESSAGES, stream=True, **_openai(CHAT_PARAMS)
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ours["text"]

    async def ask():
        async with async_sdk(server) as client:
            stream = await client.chat.completions.create(
                model=TINY, messages=MESSAGES, stream=True, **_openai(CHAT_PARAMS)
            )
            return [c async for c in stream]

    chunks = asyncio.run(ask())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ours["text"]
    assert chunks[-1].choices[0].finish_reason == ours["finish_reason"]


def test_echo_scores_the_prompt_like_the_model(server, tokenizer):
    """lm-eval's log-likelihood request: the prompt's token log-probs (``echo`` +
    ``logprobs``, ``max_tokens=0``: scoring only), against the model run by transformers."""
    text = "12+34=46"
    answer = sdk(server).completions.create(
        model=TINY, prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    (choice,) = answer.choices
    assert choice.text == text
    assert choice.logprobs.tokens == list(text)
    assert choice.logprobs.token_logprobs[0] is None
    path = builtin_model_path(TINY)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.shape[1] == len(text)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits.float().log_softmax(-1)
    expected = logits[0, :-1].gather(-1, ids[0, 1:, None])[:, 0].tolist()
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    tops = choice.logprobs.top_logprobs[1:]
    for token, top in zip(choice.logprobs.tokens[1:], tops, strict=True):
        assert token in top  # the chosen token, beside the most likely one


def test_echo_without_logprobs_echoes_the_prompt(server):
    """``echo`` with ``max_tokens=0`` and no ``logprobs`` (it was a 500): the prompt back."""
    answer = sdk(server).completions.create(model=TINY, prompt="12+34=", echo=True, max_tokens=0)
    (choice,) = answer.choices
    assert choice.text == "12+34=" and choice.logprobs is None


@pytest.mark.parametrize(
    "model", ["x" * 300, "builtin:" + "x" * 5000, "builtin:../../x", "builtin:tiny\x00"]
)
def test_a_model_name_no_model_could_have_is_a_400_before_a_job(server, service, model):
    """Names no file could have (a part over 255 bytes) and built-ins that do not exist were
    500s or failed jobs, one per request: a 400 naming ``model``, no job made."""
    jobs = len(service.list_jobs(owner=BOB_OWNER))
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server, BOB).completions.create(model=model, prompt="1", max_tokens=1)
    assert caught.value.body["param"] == "model", caught.value.body
    assert len(service.list_jobs(owner=BOB_OWNER)) == jobs


def test_models_lists_what_the_caller_may_use(server, run):
    alice = [m.id for m in sdk(server).models.list()]
    bob = [m.id for m in sdk(server, BOB).models.list()]
    assert TINY in alice and TINY in bob
    assert run.checkpoint in alice and run.checkpoint not in bob


def test_a_wrong_key_is_a_401(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk(server, key="not-a-token").completions.create(model=TINY, prompt="1")
    assert caught.value.body["type"] == "authentication_error"
    response = httpx.post(
        server + "/oai/api/v1/completions",
        json={"model": TINY, "prompt": "1", "max_tokens": 1},
        headers={"X-API-Key": "not-a-token"},
    )
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_another_tenant_s_checkpoint_is_a_404(server, run):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(server, BOB).completions.create(model=run.checkpoint, prompt="1", max_tokens=1)
    assert run.job_id in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        sdk(server, BOB).chat.completions.create(
            model=f"{TINY};{run.checkpoint}", messages=MESSAGES
        )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"top_p": 2}, "top_p"),
        ({"extra_body": {"guided_regex": "[0-9]+"}}, "guided_regex"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_or_unsupported_parameters_are_a_400_naming_them(server, service, extra, param):
    jobs = len(service.list_jobs(owner=BOB_OWNER))
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server, BOB).completions.create(model=TINY, prompt="1", **extra)
    error = caught.value.body
    assert error["param"] == param
    assert param in error["message"]
    assert len(service.list_jobs(owner=BOB_OWNER)) == jobs


def test_neutral_values_of_unsupported_parameters_are_accepted(server):
    answer = sdk(server, BOB).completions.create(
        model=TINY, prompt="1", max_tokens=1, presence_penalty=0, frequency_penalty=0, best_of=1
    )
    assert len(answer.choices) == 1


def test_a_huge_n_is_a_413_naming_the_limit(server, service):
    before = service.list_jobs(owner=BOB_OWNER)
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(server, BOB).completions.create(model=TINY, prompt="1", n=MAX_SAMPLES + 1)
    assert caught.value.status_code == 413
    error = caught.value.body
    assert error["code"] == "limit_exceeded" and error["param"] == "max_samples_per_request"
    assert "--max-samples-per-request" in error["message"]
    assert service.list_jobs(owner=BOB_OWNER) == before  # refused before a job started


def _openai(params: dict) -> dict:
    """Our sampling parameters as the SDK's keyword arguments."""
    return {k: v for k, v in params.items() if k in ("n", "max_tokens", "seed", "temperature")} | (
        {"logprobs": params["logprobs"]} if "logprobs" in params else {}
    )
