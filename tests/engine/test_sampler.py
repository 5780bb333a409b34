"""SamplingEngine against independent references: transformers' generate and plain forwards.

The built-in tiny model's random initialisation gives nearly uniform, repetitive predictions, so
the module perturbs its weights once (fixed seed) and loads them into both the reference model and
the engine: greedy continuations are then varied and some end at an end-of-sequence token.
"""

import pytest
import torch

from arctic_platform.contract.problems import FieldError
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.weights import export_weights
from tests.perturbed import perturbed

MODEL = ModelConfig(name="builtin:tiny")
PROMPTS = ["hello world", "The cat", "1+1=", "a", "What is the meaning of life?", "x" * 40]


@pytest.fixture(scope="module")
def reference():
    return perturbed(load_causal_lm(MODEL))


@pytest.fixture(scope="module")
def engine(reference):
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL))
    engine.load_weights(export_weights(reference))
    return engine


@pytest.fixture(scope="module")
def small_engine(reference):
    """Tiny waves (3 rows) and a short context: forces wave splitting and n split across waves."""
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL, max_batch_size=3, max_model_len=64))
    engine.load_weights(export_weights(reference))
    return engine


def _ids(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _hf_greedy(model, ids, max_new, **kwargs):
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, pad_token_id=0, **kwargs
    )
    return out[0, len(ids) :].tolist()


def _strip_after_eos(tokens, eos=(3, 1)):
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def test_greedy_matches_transformers_generate(engine, reference):
    outs = engine.generate(PROMPTS, {"temperature": 0, "max_tokens": 30, "n": 2})
    assert len(outs) == 2 * len(PROMPTS)
    finish = set()
    for i, prompt in enumerate(PROMPTS):
        ids = _ids(engine, prompt)
        expected = _strip_after_eos(_hf_greedy(reference, ids, 30))
        for s in range(2):
            out = outs[2 * i + s]
            assert (out["prompt_index"], out["sample_index"]) == (i, s)
            assert out["prompt_len"] == len(ids)
            assert out["token_ids"] == expected
            finish.add(out["finish_reason"])
            ends_at_eos = expected[-1] in engine.eos_token_ids
            assert out["finish_reason"] == ("stop" if ends_at_eos else "length")
            text_ids = expected[:-1] if ends_at_eos else expected
            assert out["text"] == engine.tokenizer.decode(text_ids, skip_special_tokens=True)
    assert finish == {"stop", "length"}  # both paths (and early-finish compaction) exercised


def test_greedy_matches_transformers_generate_without_padding(engine, reference):
    # Prompts of one length take the unmasked decoding path.
    prompts = ["12+34=", "56+78=", "90+12="]
    outs = engine.generate(prompts, {"temperature": 0, "max_tokens": 30})
    for prompt, out in zip(prompts, outs, strict=True):
        expected = _strip_after_eos(_hf_greedy(reference, _ids(engine, prompt), 30))
        assert out["token_ids"] == expected


def test_token_id_prompts_equal_text_prompts(engine):
    params = {"temperature": 0.8, "seed": 11, "max_tokens": 12}
    by_text = engine.generate(PROMPTS[:3], params)
    by_ids = engine.generate([_ids(engine, p) for p in PROMPTS[:3]], params)
    assert [o["token_ids"] for o in by_text] == [o["token_ids"] for o in by_ids]


def test_waves_and_split_samples_do_not_change_results(engine, small_engine):
    params = [{"temperature": 0, "max_tokens": 20, "n": 4}, {"seed": 5, "max_tokens": 20, "n": 5}]
    big = engine.generate(PROMPTS[:2], params)
    small = small_engine.generate(PROMPTS[:2], params)
    assert [o["token_ids"] for o in big] == [o["token_ids"] for o in small]


def test_min_tokens_matches_generate_min_new_tokens(engine, reference):
    prompt = PROMPTS[4]  # greedy ends at an end-of-sequence token after a few tokens
    ids = _ids(engine, prompt)
    assert len(_strip_after_eos(_hf_greedy(reference, ids, 30))) < 20
    out = engine.generate([prompt], {"temperature": 0, "max_tokens": 30, "min_tokens": 20})[0]
    assert out["token_ids"] == _strip_after_eos(_hf_greedy(reference, ids, 30, min_new_tokens=20))
    assert not set(out["token_ids"][:20]) & set(engine.eos_token_ids)


def test_ignore_eos_runs_to_max_tokens(engine):
    stopped = engine.generate(["1+1="], {"temperature": 0, "max_tokens": 40})[0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] is None
    assert stopped["token_ids"][-1] in engine.eos_token_ids
    free = engine.generate(["1+1="], {"temperature": 0, "max_tokens": 40, "ignore_eos": True})[0]
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 40
    assert free["token_ids"][: len(stopped["token_ids"])] == stopped["token_ids"]


def test_eos_text_kept_only_when_asked(engine):
    params = {"temperature": 0, "max_tokens": 40, "skip_special_tokens": False}
    plain = engine.generate(["1+1="], params)[0]
    kept = engine.generate(["1+1="], {**params, "include_stop_str_in_output": True})[0]
    assert not plain["text"].endswith("<|im_end|>")
    assert kept["text"] == plain["text"] + "<|im_end|>"


def test_stop_token_ids(engine):
    greedy = engine.generate(["hello world"], {"temperature": 0, "max_tokens": 30})[0]
    stop_id = greedy["token_ids"][6]
    first = greedy["token_ids"].index(stop_id)
    out = engine.generate(
        ["hello world"], {"temperature": 0, "max_tokens": 30, "stop_token_ids": [stop_id]}
    )[0]
    assert out["token_ids"] == greedy["token_ids"][: first + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop_id)
    assert out["text"] == engine.tokenizer.decode(greedy["token_ids"][:first])


def test_stop_strings(engine):
    greedy = engine.generate(["hello world"], {"temperature": 0, "max_tokens": 30})[0]
    text = greedy["text"]
    stop = text[8:11]
    cut = text.find(stop)
    params = {"temperature": 0, "max_tokens": 30, "stop": ["@@never@@", stop]}
    out = engine.generate(["hello world"], params)[0]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop)
    assert out["text"] == text[:cut]
    # token_ids run up to the token that completed the string, as in vLLM
    n = len(out["token_ids"])
    assert out["token_ids"] == greedy["token_ids"][:n]
    assert stop in engine.tokenizer.decode(out["token_ids"])
    assert stop not in engine.tokenizer.decode(out["token_ids"][:-1])
    kept = engine.generate(["hello world"], {**params, "include_stop_str_in_output": True})[0]
    assert kept["text"] == text[: cut + len(stop)]
    # not looked for before min_tokens: the same string then stops at a later occurrence or never
    late = engine.generate(["hello world"], {**params, "min_tokens": n + 1})[0]
    assert len(late["token_ids"]) > n


def _forward_log_probs(model, prompt_ids, generated, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0].float()
    positions = range(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(generated))
    return torch.stack([torch.log_softmax(logits[p] / temperature, dim=-1) for p in positions])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_an_independent_forward(engine, reference, temperature):
    params = {"temperature": temperature, "max_tokens": 12, "n": 2, "seed": 3, "logprobs": 3}
    outs = engine.generate(PROMPTS[:3], params)
    scale = temperature or 1.0  # greedy reports the unscaled distribution
    for out in outs:
        ids = _ids(engine, PROMPTS[out["prompt_index"]])
        expected = _forward_log_probs(reference, ids, out["token_ids"], scale)
        assert len(out["logprobs"]) == len(out["token_ids"])
        for t, entry in enumerate(out["logprobs"]):
            token = out["token_ids"][t]
            assert entry["token_id"] == token
            # float32 rounding of two differently shaped forwards (batched with a KV cache, or
            # one row at once) grows with the log-prob's size: relative and absolute tolerance
            # (kernels differ by CPU: AVX-512 machines round differently from AVX2 ones)
            close = {"rel": 5e-5, "abs": 1e-5}
            assert entry["logprob"] == pytest.approx(expected[t, token].item(), **close)
            # vLLM's rank: 1 + how many tokens are likelier than the sampled one
            assert entry["rank"] == 1 + int((expected[t] > expected[t, token] + 1e-6).sum())
            top_values, top_ids = expected[t].topk(3)
            assert [i for i, _ in entry["top"]] == top_ids.tolist()
            assert [v for _, v in entry["top"]] == pytest.approx(top_values.tolist(), **close)


def test_logprobs_zero_gives_only_the_sampled_token(engine):
    out = engine.generate(["a"], {"max_tokens": 3, "logprobs": 0, "seed": 1})[0]
    assert all(entry["top"] == [] for entry in out["logprobs"])
    assert "logprobs" not in engine.generate(["a"], {"max_tokens": 3})[0]


def test_seeded_samples_are_reproducible_and_independent_of_the_batch(engine):
    params = {"n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 15}
    alone = [o["token_ids"] for o in engine.generate(["hello world"], params)]
    assert alone == [o["token_ids"] for o in engine.generate(["hello world"], params)]
    assert len({tuple(t) for t in alone}) == 3  # the n samples differ from each other
    mixed = engine.generate(
        ["x" * 40, "hello world", "The cat"],
        [{"seed": 1, "max_tokens": 20, "n": 2}, params, {"temperature": 0, "top_k": 3}],
    )
    assert [o["token_ids"] for o in mixed[2:5]] == alone
    other_seed = engine.generate(["hello world"], {**params, "seed": 8})
    assert [o["token_ids"] for o in other_seed] != alone


def test_unseeded_requests_draw_fresh_seeds(engine):
    params = {"n": 2, "max_tokens": 15}
    first = [o["token_ids"] for o in engine.generate(["hello world"], params)]
    second = [o["token_ids"] for o in engine.generate(["hello world"], params)]
    assert first != second


def _first_token_distribution(model, ids):
    with torch.no_grad():
        return torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


@pytest.mark.parametrize(
    ("name", "params"),
    [("top_k", {"top_k": 5}), ("top_p", {"top_p": 0.3}), ("min_p", {"min_p": 0.4})],
)
def test_filters_restrict_the_support(engine, reference, name, params):
    draws = 600
    probs = _first_token_distribution(reference, _ids(engine, "hello world"))
    order = probs.argsort(descending=True).tolist()
    if name == "top_k":
        allowed = set(order[: params["top_k"]])
    elif name == "top_p":
        allowed, mass = set(), 0.0
        for token in order:
            if mass < params["top_p"]:
                allowed.add(token)
            mass += probs[token].item()
    else:
        allowed = {t for t in order if probs[t] >= params["min_p"] * probs.max()}
    assert 3 <= len(allowed) <= 8  # the setup is meaningful: a real, smallish support
    outs = engine.generate(["hello world"], {**params, "n": draws, "max_tokens": 1, "seed": 0})
    sampled = [o["token_ids"][0] for o in outs]
    assert set(sampled) == allowed  # nothing outside, and all of it used
    # frequencies follow the renormalised probabilities (chi-square, 7 dof max, p ~ 1e-4)
    support = sorted(allowed)
    expected = probs[support] / probs[support].sum() * draws
    observed = torch.tensor([sampled.count(t) for t in support], dtype=torch.float32)
    assert ((observed - expected) ** 2 / expected).sum().item() < 30
    unfiltered = engine.generate(["hello world"], {"n": draws, "max_tokens": 1, "seed": 0})
    assert not {o["token_ids"][0] for o in unfiltered} <= allowed


def test_prefix_is_prefilled_once_for_all_samples(engine):
    engine.reset_prefix_cache()  # earlier tests' calls may have cached the prompt
    seen = []
    hook = engine.model.get_input_embeddings().register_forward_hook(
        lambda _module, args, _out: seen.append(args[0].numel())
    )
    try:
        engine.generate(["hello world"], {"n": 4, "max_tokens": 6, "min_tokens": 6})
    finally:
        hook.remove()
    prompt_len = len(_ids(engine, "hello world"))
    assert seen == [prompt_len] + [4] * 5  # one prefill, then 4 rows per decode step


def test_max_tokens_none_fills_the_context(small_engine):
    out = small_engine.generate(["hello"], {"max_tokens": None, "ignore_eos": True, "seed": 1})[0]
    assert len(out["token_ids"]) == 64 - 5 and out["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        (["a"], {"temperature": -1}, "sampling_params.temperature"),
        (["a"], {"top_p": 0}, "sampling_params.top_p"),
        (["a"], {"top_p": 1.01}, "sampling_params.top_p"),
        (["a"], {"max_tokens": 0}, "sampling_params.max_tokens"),
        (["a"], {"top_pp": 0.5}, "sampling_params.top_pp"),
        (["a", "b"], [None, {"n": 0}], "sampling_params[1].n"),
        (["a", "b"], [None], "sampling_params"),
        (["a"], {"stop_token_ids": [102]}, "sampling_params.stop_token_ids"),
        (["a"], {"logprobs": 21}, "sampling_params.logprobs"),
        (["a", "x" * 60], {"max_tokens": 5}, "prompts[1]"),
        (["a", ""], None, "prompts[1]"),
        ([[5, 6, 102]], None, "prompts[0]"),
        ([[5, -1]], None, "prompts[0]"),
        ([[]], None, "prompts[0]"),
        ([3.5], None, "prompts[0]"),
        ("hello", None, "prompts"),
        ([], None, "prompts"),
    ],
)
def test_bad_requests_name_the_field(small_engine, prompts, params, field):
    with pytest.raises(FieldError) as err:
        small_engine.generate(prompts, params)
    assert err.value.field == field


def test_rejected_request_changes_nothing(small_engine):
    params = {"n": 2, "max_tokens": 8}
    weights = {k: v.clone() for k, v in small_engine.model.state_dict().items()}
    rng = small_engine._shaper._seed_rng.get_state()
    with pytest.raises(FieldError):
        small_engine.generate(["a", "b"], [params, {"top_p": 5}])
    assert torch.equal(small_engine._shaper._seed_rng.get_state(), rng)  # no seed was drawn
    for k, v in small_engine.model.state_dict().items():
        assert torch.equal(v, weights[k])


def test_sleep_and_wake_in_any_order(engine, reference):
    params = {"temperature": 0, "max_tokens": 20}
    expected = [_strip_after_eos(_hf_greedy(reference, _ids(engine, p), 20)) for p in PROMPTS[:2]]
    engine.generate(PROMPTS[:2], params)
    assert engine.wake()["woke"] == []  # waking an awake engine is a no-op
    first = engine.sleep(1)
    assert first["kv_cache_bytes_released"] > 0 and first["asleep"] == ["kv_cache"]
    assert engine.sleep(1)["kv_cache_bytes_released"] == 0  # idempotent
    deep = engine.sleep(2)
    assert "kept" in deep["weights"]  # CPU: nothing to offload, and it says so
    woke = engine.wake(["kv_cache"])
    assert (
        woke["woke"] == ["kv_cache"] and woke["kv_cache_bytes"] == first["kv_cache_bytes_released"]
    )
    assert engine.wake(["weights"])["woke"] == []
    assert [o["token_ids"] for o in engine.generate(PROMPTS[:2], params)] == expected
    engine.sleep(2)
    # generate while asleep wakes implicitly and still matches the reference
    assert [o["token_ids"] for o in engine.generate(PROMPTS[:2], params)] == expected
    assert engine.wake()["asleep"] == []
    assert engine.reset_prefix_cache()["cached_prefixes"] == 2  # the last call's prompts
    with pytest.raises(FieldError) as err:
        engine.sleep(3)
    assert err.value.field == "level"
    with pytest.raises(FieldError) as err:
        engine.wake(["weights", "optimizer"])
    assert err.value.field == "tags"
