"""The Tinker API as one more surface of the conformance suite, on the same fake-engine Service.

Tinker's ops have their own shapes (datums, LoRA training clients, snapshot samplers), so what is
held against the other surfaces is what carries over: a sample drawn with the same seed is the
same tokens; the script's bad requests that Tinker can send are refused with the same status and
code, and a ``field`` that is the same field as Tinker's request spells it; and a snapshot
sampler keeps its weights while the trainer trains on, through the training engine Protocol's
``weight_snapshot`` (so the fake engine serves Tinker as the real one does).
"""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker", reason="the tinker SDK (Python >= 3.11) is not installed")

from tinker import types  # noqa: E402

from arctic_platform.server.service import Service, ServiceSettings  # noqa: E402
from tests.conformance.script import (  # noqa: E402
    OUT_OF_VOCAB,
    PROMPTS,
    SAMPLING,
    run_script,
)
from tests.conformance.surfaces import fake_surfaces  # noqa: E402
from tests.fake_engine import build_fake_engine  # noqa: E402
from tests.live_server import serve_app  # noqa: E402
from tests.server.conftest import TINY, make_app  # noqa: E402

KEY = "tml-conformance"
PARAMS = types.SamplingParams(
    max_tokens=SAMPLING["max_tokens"], temperature=SAMPLING["temperature"], seed=SAMPLING["seed"]
)
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(PROMPTS[1][:-1]),
    loss_fn_inputs={"target_tokens": PROMPTS[1][1:], "weights": [1.0] * (len(PROMPTS[1]) - 1)},
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The fake-engine Service over 127.0.0.1, the script's answers on the on-prem surface, and
    a Tinker ServiceClient."""
    service = Service(
        ServiceSettings(data_dir=tmp_path_factory.mktemp("server"), device="cpu"),
        engine_builder=build_fake_engine,
    )
    with serve_app(make_app(service)) as url:
        surfaces = fake_surfaces(service, url, tmp_path_factory.mktemp("client"))
        with surfaces["http"]() as client:
            answers = run_script(client)
        sdk = tinker.ServiceClient(base_url=url, api_key=KEY)
        yield answers, sdk
        sdk.close("success").result()
    service.close()


def tokens_of(response) -> list[list[int]]:
    return [list(s.tokens) for s in response.sequences]


def test_a_seeded_tinker_sample_is_the_other_surfaces_generate(served):
    answers, sdk = served
    sampler = sdk.create_sampling_client(base_model=TINY)
    for index, prompt in enumerate(PROMPTS):
        got = sampler.sample(types.ModelInput.from_ints(prompt), SAMPLING["n"], PARAMS).result()
        want = [s["token_ids"] for s in answers["generate"] if s["prompt_index"] == index]
        assert tokens_of(got) == [list(t) for t in want]


def refused(call) -> tuple[int, str, str | None, str]:
    with pytest.raises(tinker.APIStatusError) as info:
        call()
    body = info.value.body
    return info.value.status_code, body["code"], body.get("field"), body["message"]


def test_tinker_refuses_the_scripts_bad_requests_alike(served):
    """Each refusal's status and code equal the on-prem surface's for the same mistake, and its
    ``field`` (named in the message too) is that field as Tinker's request spells it."""
    answers, sdk = served
    trainer = sdk.create_lora_training_client(base_model=TINY, rank=4, seed=3)
    sampler = trainer.save_weights_and_get_sampling_client("conformance")
    cases = {
        "log_probs!": (
            lambda: sampler.compute_logprobs(types.ModelInput.from_ints([OUT_OF_VOCAB])).result(),
            "prompt",  # on-prem: prompts[0]
        ),
        "fwd_bwd!": (
            lambda: trainer.forward_backward([DATUM], "no_such_loss").result(),
            "loss_fn",  # on-prem: processing.loss_fn
        ),
        "step!": (
            lambda: trainer.optim_step(types.AdamParams(learning_rate=-1.0)).result(),
            "adam_params.learning_rate",  # on-prem: learning_rate
        ),
    }
    for op, (call, field) in cases.items():
        status, code, got_field, message = refused(call)
        want_status, want_code, _, _ = answers[op]
        assert (status, code) == (want_status, want_code), (op, message, answers[op])
        assert got_field == field and field in message, (op, got_field, message)


def test_a_snapshot_sampler_keeps_its_weights_on_the_fake_engine(served):
    """The Tinker layer takes and loads snapshots only through the engine Protocol, so the fake
    trainer serves it: a sampler made before a step samples the same after it, one made after
    samples the new weights."""
    _, sdk = served
    trainer = sdk.create_lora_training_client(base_model=TINY, rank=4, seed=3)
    prompt = types.ModelInput.from_ints(PROMPTS[0])
    before = trainer.save_weights_and_get_sampling_client("before")
    first = tokens_of(before.sample(prompt, 2, PARAMS).result())
    trainer.forward_backward([DATUM], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=0.5)).result()
    after = trainer.save_weights_and_get_sampling_client("after")
    assert tokens_of(after.sample(prompt, 2, PARAMS).result()) != first
    assert tokens_of(before.sample(prompt, 2, PARAMS).result()) == first
