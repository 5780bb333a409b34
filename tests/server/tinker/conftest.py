"""The real ``tinker`` SDK (PyPI, a test dependency) against our server on loopback.

One server per module (engines take seconds to load on CPU); two tenants, ``tml-alice`` and
``tml-bob``, in the form the SDK requires. Tests that need untouched weights create their own
training client; a LoRA adapter starts as the identity (peft initialises B to zero), so a fresh
client computes exactly what the base model computes, which :func:`reference_logprobs` evaluates
with plain transformers.
"""

from __future__ import annotations

import functools

import pytest
import torch

from arctic_platform.engine.config import ModelConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app

tinker = pytest.importorskip("tinker", reason="the tinker SDK (Python >= 3.11) is not installed")

TINY = "builtin:tiny"
ALICE, BOB = "tml-alice", "tml-bob"


@pytest.fixture(scope="module")
def server_app(tmp_path_factory):
    data = tmp_path_factory.mktemp("tinker-data")
    service = Service(ServiceSettings(data_dir=data, device="cpu"))
    return create_app(service, auth=TokenAuth([ALICE, BOB]))


@pytest.fixture(scope="module")
def server_url(server_app):
    with serve_app(server_app) as url:
        yield url


@pytest.fixture(scope="module")
def alice(server_url):
    """Alice's plain HTTP client (:mod:`.plain_http`)."""
    from tests.server.tinker.plain_http import TinkerHttp

    client = TinkerHttp(server_url, ALICE)
    yield client
    client.close()


@pytest.fixture(scope="module")
def run(alice):
    """``(session id, model id)`` of a training run of Alice's on the tiny model."""
    session = alice.session()
    return session, alice.training_run(session, TINY)


@pytest.fixture(scope="module")
def service_client(server_url):
    client = tinker.ServiceClient(base_url=server_url, api_key=ALICE)
    yield client
    client.close("success").result()


@functools.cache
def _reference_model():
    return load_causal_lm(ModelConfig(name=TINY, device="cpu")).eval()


def reference_logprobs(tokens: list[int], targets: list[int]) -> list[float]:
    """``log p(targets[j] | tokens[:j+1])`` under the base model, by plain transformers."""
    with torch.no_grad():
        logits = _reference_model()(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[j, t]) for j, t in enumerate(targets)]


def encode(text: str) -> list[int]:
    from arctic_platform.engine.builtin import build_tokenizer

    return build_tokenizer().encode(text, add_special_tokens=False)


def sft_datum(text: str, prompt_len: int):
    """``(token ids, a cross_entropy Datum)`` training the tokens after the first
    ``prompt_len``."""
    ids = encode(text)
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(ids) - prompt_len)
    return ids, tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )


def check_snapshots_keep_their_weights(service_client) -> None:
    """Tinker semantics: a client from save_weights_and_get_sampling_client samples the weights of
    that moment (tokens, their log-probs and prompt log-probs), whatever the training client saves
    later. Shared by the in-process and the Ray backend's tests."""
    types = tinker.types
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=6).result()
    prompt = types.ModelInput.from_ints(encode("12+34="))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)

    def draw(sampler):  # a deadline, not a hang, if the server never answers
        out = sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result(300)
        seq = out.sequences[0]
        return list(seq.tokens), list(seq.logprobs), out.prompt_logprobs

    first = client.save_weights_and_get_sampling_client().result()
    before = draw(first)
    assert before[2][0] is None and len(before[2]) == prompt.length
    _, datum = sft_datum("12+34=46", 6)
    for _ in range(3):
        client.forward_backward([datum], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-2))
    second = client.save_weights_and_get_sampling_client().result()
    moved = draw(second)
    assert moved[1] != before[1]  # the new snapshot samples the trained weights
    assert draw(first) == before  # the old one still samples its own
    assert draw(second) == moved
