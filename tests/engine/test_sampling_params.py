"""Validation of vLLM-style sampling parameters: defaults, normalisation, and named errors."""

import pytest

from arctic_platform.contract.problems import FieldError
from arctic_platform.contract.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams.from_request(None)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert (p.seed, p.logprobs) == (None, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.greedy


def test_skyrl_dictionary_is_accepted_and_normalised():
    # The dictionary SkyRL's get_vllm_sampling_params builds (reference/skyrl_tinker.md §1.6).
    p = SamplingParams.from_request(
        {
            "min_tokens": 1,
            "skip_special_tokens": True,
            "include_stop_str_in_output": True,
            "max_tokens": 1024,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "logprobs": 1,
            "stop": None,
        }
    )
    assert p.max_tokens == 1024 and p.logprobs == 1 and p.stop == () and p.min_tokens == 1
    assert SamplingParams.from_request({"top_k": 0}).top_k == -1
    assert SamplingParams.from_request({"stop": "###"}).stop == ("###",)
    assert SamplingParams.from_request({"stop_token_ids": [5, 7]}).stop_token_ids == (5, 7)
    assert SamplingParams.from_request({"temperature": 0}).greedy
    assert SamplingParams.from_request({"max_tokens": None}).max_tokens is None
    assert SamplingParams.from_request({"n": 2.0}).n == 2


def test_instances_pass_through():
    p = SamplingParams(n=3)
    assert SamplingParams.from_request(p) is p


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_pp": 0.9}, "sampling_params.top_pp"),
        ({"repetition_penalty": 1.1}, "sampling_params.repetition_penalty"),
        ({"temperature": -0.1}, "sampling_params.temperature"),
        ({"temperature": float("nan")}, "sampling_params.temperature"),
        ({"temperature": "hot"}, "sampling_params.temperature"),
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"top_p": 1.5}, "sampling_params.top_p"),
        ({"top_k": -2}, "sampling_params.top_k"),
        ({"top_k": 2.5}, "sampling_params.top_k"),
        ({"min_p": 1.5}, "sampling_params.min_p"),
        ({"max_tokens": 0}, "sampling_params.max_tokens"),
        ({"max_tokens": True}, "sampling_params.max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "sampling_params.min_tokens"),
        ({"min_tokens": -1}, "sampling_params.min_tokens"),
        ({"n": 0}, "sampling_params.n"),
        ({"stop": ["ok", ""]}, "sampling_params.stop[1]"),
        ({"stop": 5}, "sampling_params.stop"),
        ({"stop_token_ids": [1, -3]}, "sampling_params.stop_token_ids[1]"),
        ({"stop_token_ids": 3}, "sampling_params.stop_token_ids"),
        ({"seed": "x"}, "sampling_params.seed"),
        ({"logprobs": -1}, "sampling_params.logprobs"),
        ({"ignore_eos": 1}, "sampling_params.ignore_eos"),
    ],
)
def test_bad_values_name_the_field(params, field):
    with pytest.raises(FieldError) as err:
        SamplingParams.from_request(params)
    assert err.value.field == field
    assert field in str(err.value)


def test_unknown_keys_are_all_listed():
    with pytest.raises(FieldError) as err:
        SamplingParams.from_request({"top_pp": 1, "best_of": 2})
    assert "best_of" in str(err.value) and "top_pp" in str(err.value)


def test_field_prefix_for_per_prompt_params():
    with pytest.raises(FieldError) as err:
        SamplingParams.from_request({"top_p": 2}, "sampling_params[3]")
    assert err.value.field == "sampling_params[3].top_p"


def test_not_a_mapping():
    with pytest.raises(FieldError) as err:
        SamplingParams.from_request([("n", 1)])
    assert err.value.field == "sampling_params"
