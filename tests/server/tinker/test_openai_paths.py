"""A Tinker sampler checkpoint served by the OpenAI-compatible API: ``model`` is the
``tinker://<model_id>/sampler_weights/<name>`` path the Tinker SDK returned, and the official
``openai`` SDK gets exactly what the Tinker sampling client samples from it (see conftest)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.server.tinker.conftest import ALICE, BOB, TINY, sft_datum, tinker

openai = pytest.importorskip("openai", reason="the openai SDK (dev extra) is not installed")
types = tinker.types
pytestmark = pytest.mark.slow


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_a_tinker_sampler_path_is_a_model_of_its_owner_only(service_client, server_url):
    client = service_client.create_lora_training_client(base_model=TINY, rank=4, seed=7).result()
    ids, datum = sft_datum("40+2=42", 5)
    client.forward_backward([datum], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = client.save_weights_for_sampler("served").result().path
    assert path == f"tinker://{client.model_id}/sampler_weights/served"

    prompt = ids[:5]
    sampler = service_client.create_sampling_client(model_path=path).result()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]

    alice = sdk(server_url, ALICE)
    assert path in {m.id for m in alice.models.list().data}
    answer = alice.completions.create(
        model=path, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=0
    )
    choice = answer.choices[0]
    assert answer.model == path
    assert len(choice.logprobs.tokens) == len(sampled.tokens)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, sampled.logprobs, rtol=1e-5)

    bob = sdk(server_url, BOB)
    assert path not in {m.id for m in bob.models.list().data}
    with pytest.raises(openai.NotFoundError):
        bob.completions.create(model=path, prompt=prompt, max_tokens=4)
