"""The vLLM engine generates what our sampler generates, and fails where it fails.

One vLLM engine and one of ours, both on the same perturbed tiny model. Greedy decoding must agree
token for token (and in text, finish and stop reasons) under every stopping rule; seeded sampling
must repeat; the log-probs of sampled tokens must equal independent computations (our log-prob
engine at temperature 1, a plain forward at another temperature); bad requests must be refused
with our errors before vLLM sees them.
"""

from __future__ import annotations

import threading

import pytest
import torch

from arctic_platform.contract.problems import FieldError
from arctic_platform.engine import cancellation
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.logprob_engine import LogProbEngine
from arctic_platform.engine.sampler import SamplingEngine
from tests.sampled import sampled
from tests.vllm.conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]

PROMPTS = ["hello world", "The cat", "1+1=", "What is the meaning of life?", [40, 41, 42, 43]]
GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def ours(perturbed_model_dir):
    return SamplingEngine(SamplingEngineConfig(model=ModelConfig(name=perturbed_model_dir)))


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine


def test_greedy_equals_ours(engine, ours):
    theirs, mine = engine.generate(PROMPTS, GREEDY), ours.generate(PROMPTS, GREEDY)
    assert sampled(theirs) == sampled(mine)
    assert {o["finish_reason"] for o in mine} == {"stop", "length"}  # both endings occur


def _stopping_cases(ours) -> list[dict]:
    """Stop rules that certainly fire: built from our greedy continuations."""
    base = ours.generate(PROMPTS[:3], {**GREEDY, "ignore_eos": True})
    text, ids = base[0]["text"], base[1]["token_ids"]
    return [
        {**GREEDY, "stop": [text[4:6]]},
        {**GREEDY, "stop": [text[4:6]], "include_stop_str_in_output": True},
        {**GREEDY, "stop_token_ids": [ids[5]]},
        {**GREEDY, "stop_token_ids": [ids[5]], "min_tokens": 8},
        {**GREEDY, "ignore_eos": True, "max_tokens": 30},
        {**GREEDY, "n": 3, "max_tokens": 5},
        {"temperature": 0.0, "max_tokens": None},
    ]


def test_n_stop_and_max_tokens_equal_ours(engine, ours):
    for params in _stopping_cases(ours):
        theirs, mine = engine.generate(PROMPTS, params), ours.generate(PROMPTS, params)
        assert sampled(theirs) == sampled(mine), params
    reasons = {o["stop_reason"] for p in _stopping_cases(ours) for o in ours.generate(PROMPTS, p)}
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)


def test_seeded_sampling_repeats_run_to_run(engine):
    params = {"temperature": 1.0, "max_tokens": 16, "n": 4, "seed": 7}
    first = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == first
    samples = {tuple(o["token_ids"]) for o in first if o["prompt_index"] == 0}
    assert len(samples) > 1  # the n samples of a prompt differ
    other = engine.generate(PROMPTS, {**params, "seed": 8})
    assert [o["token_ids"] for o in other] != [o["token_ids"] for o in first]


def test_logprobs_of_sampled_tokens_equal_our_logprob_engine(engine, perturbed_model_dir):
    params = {"temperature": 1.0, "max_tokens": 12, "seed": 3, "logprobs": 2}
    outputs = engine.generate(PROMPTS, params)
    scorer = LogProbEngine(ModelConfig(name=perturbed_model_dir))
    prompt_ids = [
        engine.tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else p
        for p in PROMPTS
    ]
    scored = scorer.log_probs(prompt_ids, [o["token_ids"] for o in outputs], top_k=2)
    for output, reference in zip(outputs, scored, strict=True):
        got = [step["logprob"] for step in output["logprobs"]]
        assert [step["token_id"] for step in output["logprobs"]] == output["token_ids"]
        assert torch.allclose(torch.tensor(got), torch.tensor(reference["logprobs"]), atol=1e-5)
        for step, top in zip(output["logprobs"], reference["top_logprobs"], strict=True):
            assert [t for t, _ in step["top"]] == [t for t, _ in top]


def test_prompt_logprobs_equal_our_logprob_engine(engine, ours, perturbed_model_dir):
    """``prompt_logprobs`` has our sampler's shape (None, then one float per later token) and
    values: our log-prob engine scoring the prompt alone, within 1e-5."""
    prompts = [ours.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:4]]
    scored = LogProbEngine(ModelConfig(name=perturbed_model_dir)).log_probs(prompts)
    for prompt, reference in zip(prompts, scored, strict=True):
        got = engine.prompt_logprobs(prompt)
        assert len(got) == len(prompt) and got[0] is None and reference["logprobs"][0] is None
        assert torch.allclose(
            torch.tensor(got[1:]), torch.tensor(reference["logprobs"][1:]), atol=1e-5
        )
        mine = ours.prompt_logprobs(prompt)
        assert torch.allclose(torch.tensor(got[1:]), torch.tensor(mine[1:]), atol=1e-5)
    with pytest.raises(FieldError) as info:
        engine.prompt_logprobs([1, 10**6])
    assert info.value.field == "prompts[0]"


def test_logprobs_are_of_the_temperature_scaled_distribution(engine, ours):
    """As ours: ``log_softmax(logits / T)`` of the sampled token (a plain forward computes it)."""
    temperature = 0.7
    prompt = ours.tokenizer("The cat", add_special_tokens=False)["input_ids"]
    params = {"temperature": temperature, "max_tokens": 10, "seed": 5, "logprobs": 0}
    output = engine.generate([prompt], params)[0]
    ids = torch.tensor([prompt + output["token_ids"]])
    with torch.no_grad():
        logits = ours.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits / temperature, dim=-1)
    expected = expected.gather(1, torch.tensor(output["token_ids"])[:, None]).squeeze(1)
    got = torch.tensor([step["logprob"] for step in output["logprobs"]])
    assert torch.allclose(got, expected, atol=1e-5)
    assert all(step["top"] == [] for step in output["logprobs"])


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        ([], None, "prompts"),
        (["ok", [1, 10**6]], None, "prompts[1]"),
        (["ok"], {"top_p": 0.0}, "sampling_params.top_p"),
        (["ok"], {"repetition_penalty": 1.1}, "sampling_params.repetition_penalty"),
        (["ok"], {"logprobs": 10**3}, "sampling_params.logprobs"),
        (["ok"], {"max_tokens": 10**6}, "prompts[0]"),
        (["a", "b"], [{"n": 2}], "sampling_params"),
    ],
)
def test_bad_requests_fail_with_our_errors(engine, ours, prompts, params, field):
    errors = []
    for target in (engine, ours):
        with pytest.raises(FieldError) as info:
            target.generate(prompts, params)
        errors.append((info.value.field, str(info.value)))
    assert errors[0] == errors[1] and errors[0][0] == field


def test_sleep_wake_and_prefix_cache_on_cpu(engine):
    asleep = engine.sleep(1)
    assert asleep["asleep"] == [] and "nothing was released" in asleep["note"]
    assert engine.wake() == {"woke": [], "asleep": []}
    with pytest.raises(EngineInputError, match="tags: unknown tag"):
        engine.wake(["gpu"])
    with pytest.raises(EngineInputError, match="level: must be 1 or 2"):
        engine.sleep(3)
    assert engine.reset_prefix_cache() == {"reset": True}
    assert engine.generate(PROMPTS[:1], GREEDY)[0]["token_ids"]


def in_thread(engine, prompts, params, token: CancelToken) -> tuple[threading.Thread, list]:
    """``engine.generate`` running in a thread under ``token``; the list gets its outcome (its
    result, or the ``OpCancelled`` that ended it)."""
    outcome: list = []

    def run() -> None:
        with cancellation.scope(token):
            try:
                outcome.append(engine.generate(prompts, params))
            except cancellation.OpCancelled as exc:
                outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_cancelled_generate_is_aborted_in_the_vllm_process(engine):
    """A cancel token set while a long generation runs stops it (vLLM aborts its requests), and
    the engine then answers the next request as before."""
    before = engine.generate(PROMPTS[:2], GREEDY)
    token = CancelToken()
    endless = {"n": 256, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0}
    thread, outcome = in_thread(engine, PROMPTS[:1], endless, token)
    token.cancel("request r1 was cancelled")
    thread.join(timeout=120)
    assert not thread.is_alive()
    (stopped,) = outcome
    assert isinstance(stopped, cancellation.OpCancelled), "the generation ran to its end"
    assert stopped.reason == "request r1 was cancelled"
    assert engine.generate(PROMPTS[:2], GREEDY) == before


def test_a_generate_joins_one_that_is_decoding_and_a_stop_ends_only_its_own(engine):
    """Calls decode together in the vLLM process: a short call that arrives while a long one
    decodes comes back first, with what it gives alone; stopping the long one then leaves the
    engine answering as before (before, calls ran one at a time and the short one waited)."""
    short = {**GREEDY, "max_tokens": 6}
    alone = engine.generate(PROMPTS[2:4], short)
    token = CancelToken()
    long = {"n": 4, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0}
    thread, outcome = in_thread(engine, PROMPTS[:1], long, token)
    assert engine.generate(PROMPTS[2:4], short) == alone
    assert thread.is_alive() and not outcome, "the long call ended before the short one"
    token.cancel("done with it")
    thread.join(timeout=120)
    (stopped,) = outcome
    assert isinstance(stopped, cancellation.OpCancelled) and stopped.reason == "done with it"
    assert engine.generate(PROMPTS[2:4], short) == alone
