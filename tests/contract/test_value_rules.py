"""Values every edge checks are ruled on once (``contract.bodies``): the body models, the client
and the engines refuse the same bad value naming the same field, each in its own error kind."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from arctic_platform.client import MockTransport, SyncArcticRLClient
from arctic_platform.client.calls import prompt_list
from arctic_platform.contract.bodies import learning_rate_problem, load_source_problem
from arctic_platform.contract.ops import GenerateBody, LoadBody, LogProbsBody, StepBody
from arctic_platform.contract.problems import FieldError
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.sampling_requests import RequestShaper
from arctic_platform.server.op_bodies import describe


def tiny_shaper() -> RequestShaper:
    """The engines' request check for a 100-token vocabulary and a 32-token context."""
    config = SamplingEngineConfig(model=ModelConfig(name="builtin:tiny"))
    return RequestShaper(None, config, vocab_size=100, max_model_len=32)


BAD_PROMPTS = [
    ("2+2=", "prompts", TypeError),
    ([], "prompts", ValueError),
    ([[40, "x"]], "prompts[0]", TypeError),
    ([[1, 2], []], "prompts[1]", TypeError),
    ([[True]], "prompts[0]", TypeError),
]


@pytest.mark.parametrize("prompts, field, kind", BAD_PROMPTS)
def test_bad_prompts_name_the_same_field_at_every_edge(prompts, field, kind):
    with pytest.raises(ValidationError) as body:
        GenerateBody.model_validate({"prompts": prompts})
    assert describe(body.value).startswith(f"{field} ")
    with pytest.raises(ValidationError) as scored:
        LogProbsBody.model_validate({"prompts": [[1]], "completions": prompts})
    assert describe(scored.value).startswith(f"completions{field.removeprefix('prompts')} ")
    with pytest.raises(kind) as client:
        prompt_list("generate", prompts)
    assert str(client.value).startswith(f"generate: {field} ")
    shaper = tiny_shaper()
    with pytest.raises(EngineInputError) as engine:
        shaper.validate(prompts, None)
    assert engine.value.field == field
    assert engine.value.message in describe(body.value)


BAD_RATES = [(-0.1, ValueError), (0, ValueError), (float("inf"), ValueError), ("x", TypeError)]


@pytest.mark.parametrize("value, kind", BAD_RATES)
def test_a_bad_learning_rate_is_refused_by_the_body_and_the_client_alike(value, kind):
    with pytest.raises(ValidationError) as body:
        StepBody.model_validate({"learning_rate": value})
    assert describe(body.value).startswith("learning_rate must be")
    transport = MockTransport(lambda request: {"job_id": request.job_id})
    client = SyncArcticRLClient({"model": "builtin:tiny"}, transport=transport)
    with client, pytest.raises(kind, match="step: learning_rate must be"):
        client.step(value)
    assert transport.requests == []  # refused before anything was sent
    problem = learning_rate_problem(value)
    assert f"learning_rate {problem.message}" in describe(body.value)


def test_a_load_naming_both_a_path_and_a_checkpoint_id_is_refused_by_body_and_client():
    both = {"path": "ckpt", "checkpoint_id": "abc"}
    with pytest.raises(ValidationError) as body:
        LoadBody.model_validate(both)
    problem = load_source_problem("ckpt", "abc")
    assert describe(body.value) == str(problem)
    assert str(problem).startswith("checkpoint_id ") and "not both" in str(problem)
    transport = MockTransport(lambda request: {"job_id": request.job_id})
    client = SyncArcticRLClient({"model": "builtin:tiny"}, transport=transport)
    with client, pytest.raises(ValueError, match=f"load_checkpoint: {problem}"):
        client.load_checkpoint("ckpt", checkpoint_id="abc")
    assert transport.requests == []
    assert LoadBody.model_validate({"checkpoint_id": "abc"}).checkpoint_id == "abc"


BAD_SAMPLING = [
    ({"top_p": 2.0}, "sampling_params.top_p"),
    ({"n": 0}, "sampling_params.n"),
    ({"presence_penalty": 0.5}, "sampling_params.presence_penalty"),
    ([{"max_tokens": 4}, {"stop": [""]}], "sampling_params[1].stop[0]"),
    ("greedy", "sampling_params"),
]


@pytest.mark.parametrize("params, field", BAD_SAMPLING)
def test_bad_sampling_params_name_the_same_key_in_the_body_and_the_engine(params, field):
    prompts = ["1+2=", "3+4="]
    with pytest.raises(ValidationError) as body:
        GenerateBody.model_validate({"prompts": prompts, "sampling_params": params})
    assert describe(body.value).startswith(f"{field} ")
    shaper = tiny_shaper()
    with pytest.raises(FieldError) as engine:
        shaper.validate([[1, 2], [3]], params)
    assert engine.value.field == field
    assert engine.value.message in describe(body.value)


def test_good_values_pass_unchanged():
    assert GenerateBody.model_validate({"prompts": ["hi", [1, 2]]}).prompts == ["hi", [1, 2]]
    assert StepBody.model_validate({"learning_rate": 1e-5}).learning_rate == 1e-5
    assert prompt_list("generate", ("hi", (1, 2))) == ["hi", [1, 2]]
    params = [{"top_p": 0.9, "stop": "##"}, None]
    body = GenerateBody.model_validate({"prompts": ["a", "b"], "sampling_params": params})
    assert body.sampling_params == params  # kept as sent: the engines read it
