"""``arctic-platform serve --sampling-engine vllm``: the server's default engine over HTTP.

A real ``serve`` process started with ``--sampling-engine vllm --vllm-python ...``; a client over
the on-prem HTTP API creates a training and a sampling job without naming an engine, so its
sampler is vLLM: greedy output equals our sampler's on the same model, and weight sync reaches it
(by ``reload``, the CPU default). A job that tries to name its own vLLM interpreter is refused.
"""

from __future__ import annotations

import pytest

from arctic_platform.client import InvalidRequestError, create_arctic_rl_client
from arctic_platform.client.local_server import LocalServer, free_port
from tests.vllm.conftest import VLLM_PYTHON, check_job_generates_and_syncs, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]
TINY = "builtin:tiny"


def vllm_server(tmp_path) -> LocalServer:
    """A real ``serve`` whose default sampling engine is vLLM (this environment's)."""
    return LocalServer(
        port=free_port(),
        data_dir=tmp_path / "server",
        device="cpu",
        extra_args=("--sampling-engine", "vllm", "--vllm-python", str(VLLM_PYTHON)),
    )


def test_serve_with_vllm_as_the_default_sampling_engine(tmp_path):
    server = vllm_server(tmp_path)
    with server as url:
        config = {
            "model": "builtin:tiny",
            "seed": 0,
            "backend": {"type": "http", "url": url},
            "training": {"optimizer": {"lr": 1e-3}},
            "sampling": {},
        }
        check_job_generates_and_syncs(config, "reload")

        named = {**config, "training": None}
        named["sampling"] = {"vllm": {"python": str(VLLM_PYTHON)}}
        with pytest.raises(InvalidRequestError, match="vllm_config.python: this server runs vLLM"):
            create_arctic_rl_client(named, blocking_calls=True)


def test_the_openai_api_samples_on_vllm_what_our_sampler_does(tmp_path):
    """On a server whose sampling engine is vLLM, the OpenAI-compatible API's model jobs run on
    vLLM: the official SDK's greedy completions (with logprobs) and chat answers equal our
    sampler's on the same model and prompts."""
    openai = pytest.importorskip("openai", reason="the openai SDK (dev extra) is not installed")
    from transformers import AutoTokenizer

    from arctic_platform.engine.builtin import builtin_model_path
    from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
    from arctic_platform.engine.sampler import SamplingEngine

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path(TINY))
    messages = [{"role": "user", "content": "What is 1+2?"}]
    chat_prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    greedy = {"temperature": 0.0, "max_tokens": 8}
    ours = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name=TINY)))
    expected, expected_chat = ours.generate(["1+1=", chat_prompt], {**greedy, "logprobs": 1})
    server = vllm_server(tmp_path)
    with server as url:
        assert vllm_processes(server.pid) == []
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        completion = sdk.completions.create(model=TINY, prompt="1+1=", logprobs=1, **greedy)
        chat = sdk.chat.completions.create(model=TINY, messages=messages, **greedy)
        assert vllm_processes(server.pid), "the model job did not sample on vLLM"
    (choice,) = completion.choices
    assert choice.text == expected["text"]
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected["token_ids"]]
    want = [e["logprob"] for e in expected["logprobs"]]
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-3)
    assert chat.choices[0].message.content == expected_chat["text"]


def vllm_processes(pid: int) -> list:
    """The processes under ``pid`` that run the vLLM environment's interpreter."""
    psutil = pytest.importorskip("psutil")
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.cmdline() and child.cmdline()[0] == str(VLLM_PYTHON):
                found.append(child)
        except psutil.Error:
            pass
    return found
