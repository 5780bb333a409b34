"""The sampler's prompt cache and per-admission prompt grouping, against the same engine without
them.

Each test counts the prompts and tokens the model really prefills (a forward hook on the engine's
model) and compares outputs with an engine whose cache is off (``prompt_cache_bytes: 0``) on the
same weights, seeds fixed: token ids exactly, log-probs to float tolerance (a cached prompt's keys
and values come from an earlier prefill, padded beside other prompts).
"""

import pytest
import torch

from arctic_platform.engine import prompt_cache
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.prompt_cache import BLOCK
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.weights import export_weights
from tests.perturbed import perturbed

MODEL = ModelConfig(name="builtin:tiny")
LONG = list(range(5, 45))
SHORT = [7, 8, 9]
OTHER = [11, 12, 13, 14, 15, 16]
PARAMS = {"seed": 4, "temperature": 1.0, "max_tokens": 12, "n": 3, "logprobs": 1}
# One token each: a finished sequence then has no completion token fed, so only prompts are
# cached (for the tests whose subject is how prompt entries are kept).
ONE_TOKEN = dict(PARAMS, max_tokens=1)


@pytest.fixture(scope="module")
def weights():
    return export_weights(perturbed(load_causal_lm(MODEL)))


def _engine(weights, **settings) -> SamplingEngine:
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL, **settings))
    engine.load_weights(weights)
    return engine


@pytest.fixture(scope="module")
def uncached(weights):
    return _engine(weights, prompt_cache_bytes=0)


class Prefills:
    """The prompts (batch items) of every prefill forward of ``engine``'s model (a decode step's
    forward is the one given ``shared_prefix``), and each such forward's width in tokens."""

    def __init__(self, engine: SamplingEngine) -> None:
        self.prompts = 0
        self.widths: list[int] = []
        engine.model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"]
        if "shared_prefix" not in kwargs:
            self.prompts += ids.shape[0]
            self.widths.append(ids.shape[1])

    def since(self, before: int) -> int:
        return self.prompts - before


def _same(outputs, expected) -> None:
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    for got, want in zip(outputs, expected, strict=True):
        scores = [entry["logprob"] for entry in got["logprobs"]]
        assert scores == pytest.approx([entry["logprob"] for entry in want["logprobs"]], abs=1e-5)


def _fed(prompts: list[list[int]], outputs: list[dict], n: int) -> set[tuple[int, ...]]:
    """What each finished sequence is cached as: its prompt and its tokens but the last."""
    return {(*prompts[i // n], *o["token_ids"][:-1]) for i, o in enumerate(outputs)}


def test_a_prompt_seen_again_is_copied_not_prefilled_and_samples_the_same(weights, uncached):
    engine = _engine(weights)
    prefills = Prefills(engine)
    expected = uncached.generate([LONG, SHORT], PARAMS)
    _same(engine.generate([LONG, SHORT], PARAMS), expected)
    assert prefills.prompts == 2
    _same(engine.generate([LONG, SHORT], PARAMS), expected)
    assert prefills.since(2) == 0
    state = engine.batch_state()["prompt_cache"]
    assert (state["hits"], state["misses"], state["entries"]) == (2, 2, 2)
    assert state["hit_tokens"] == len(LONG) + len(SHORT)
    assert 0 < state["bytes"] <= state["max_bytes"]


def _poison(engine: SamplingEngine) -> None:
    """NaN in every KV buffer the next call reuses: a column it reads without writing or zeroing
    poisons its rows (a masked NaN still makes NaN)."""
    with torch.inference_mode():  # the buffers were made in it
        for buffer in engine._pool._buffers.values():
            buffer.fill_(float("nan"))


def test_a_cached_prompt_beside_new_ones_in_a_fresh_cache(weights, uncached):
    """A hit written into a fresh cache beside a narrower prompt that is prefilled at an offset:
    every column before each prompt must read as zeros, whatever the reused buffers held. (A hit
    joining a batch that is decoding: ``test_continuous_batching``.)"""
    engine = _engine(weights)
    prefills = Prefills(engine)
    engine.generate([LONG], PARAMS)
    _poison(engine)
    _same(engine.generate([LONG, OTHER], PARAMS), uncached.generate([LONG, OTHER], PARAMS))
    assert prefills.since(1) == 1  # OTHER only
    both = [dict(PARAMS, max_tokens=30), PARAMS]
    _poison(engine)
    _same(engine.generate([SHORT, LONG], both), uncached.generate([SHORT, LONG], both))
    assert prefills.since(2) == 1  # SHORT only


def test_a_prompt_sent_as_several_requests_is_prefilled_once(weights, uncached):
    """SkyRL's shape: each prompt repeated ``n`` times, ``n = 1`` each, one seed per request."""
    engine = _engine(weights, prompt_cache_bytes=0)
    prefills = Prefills(engine)
    prompts = [LONG, SHORT, LONG, LONG, SHORT, LONG, SHORT]
    params = [dict(PARAMS, n=1, seed=i) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    assert prefills.prompts == 2
    alone = [uncached.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    _same(outputs, alone)
    assert len({tuple(o["token_ids"]) for o in outputs}) > 2  # the seeds differ


def test_new_weights_are_never_served_from_the_cache(weights):
    """A weight load clears the cache; an in-place edit that skips ``load_weights`` is noticed by
    the parameters' version counters. Either way the next call equals a fresh engine's."""
    engine = _engine(weights)
    prefills = Prefills(engine)
    engine.generate([LONG], PARAMS)
    other = export_weights(perturbed(load_causal_lm(MODEL), seed=1))
    engine.load_weights(other)
    assert engine.batch_state()["prompt_cache"]["entries"] == 0
    fresh = _engine(other, prompt_cache_bytes=0)
    _same(engine.generate([LONG], PARAMS), fresh.generate([LONG], PARAMS))
    assert prefills.since(1) == 1
    with torch.no_grad():
        for model in (engine.model, fresh.model):
            model.get_input_embeddings().weight.mul_(1.5)
    _same(engine.generate([LONG], PARAMS), fresh.generate([LONG], PARAMS))
    assert prefills.since(2) == 1


def test_the_cache_stays_within_its_budget_least_recently_used_leaving_first(weights):
    first, second, third = ([start + i for i in range(20)] for start in (5, 30, 60))
    engine = _engine(weights)
    engine.generate([first], ONE_TOKEN)
    one = engine.batch_state()["prompt_cache"]["bytes"]  # every prompt here has as many tokens
    engine = _engine(weights, prompt_cache_bytes=2 * one)
    prefills = Prefills(engine)
    engine.generate([first], ONE_TOKEN)
    engine.generate([second], ONE_TOKEN)
    engine.generate([first], ONE_TOKEN)  # a hit: first is now the most recently used
    engine.generate([third], ONE_TOKEN)  # evicts second
    assert prefills.prompts == 3
    engine.generate([first, second], ONE_TOKEN)
    assert prefills.since(3) == 1
    state = engine.batch_state()["prompt_cache"]
    assert state["bytes"] == 2 * one and state["entries"] == 2

    off = _engine(weights, prompt_cache_bytes=0)
    prefills = Prefills(off)
    off.generate([LONG], ONE_TOKEN)
    off.generate([LONG], ONE_TOKEN)
    assert prefills.prompts == 2 and off.batch_state()["prompt_cache"]["entries"] == 0


def test_cached_prompts_take_only_what_the_running_batch_leaves_of_the_kv_budget(weights):
    """The batch comes first: a call whose rows need most of ``max_kv_cache_bytes`` evicts the
    cached prompts that no longer fit beside it, and the pool's buffers plus the cache never
    exceed the budget."""
    per_token = _engine(weights)._kv_bytes_per_token()
    budget = 512 * per_token
    engine = _engine(weights, max_kv_cache_bytes=budget)
    prefills = Prefills(engine)
    held = []  # pool plus cache, at every allocation of the batch's buffers
    views = engine._pool.views

    def counted_views(*args, **kwargs):
        taken = views(*args, **kwargs)
        held.append(engine._pool.nbytes + engine.batch_state()["prompt_cache"]["bytes"])
        return taken

    engine._pool.views = counted_views
    cached = engine._prompt_cache._entries
    engine.generate([LONG], PARAMS)  # 40 prompt + 3 x 12 completion columns: LONG stays cached
    assert tuple(LONG) in cached
    many = dict(PARAMS, n=20, max_tokens=24, min_tokens=24)  # 3 + 20 x 24 of 512 columns
    engine.generate([SHORT], many)
    assert tuple(SHORT) in cached and tuple(LONG) not in cached  # 29 columns left: SHORT fits
    engine.generate([LONG, SHORT], PARAMS)
    assert prefills.since(2) == 1  # LONG again; SHORT from the cache
    assert tuple(LONG) not in cached  # LONG still does not fit
    assert held and max(held) <= budget
    assert engine._pool.nbytes + engine.batch_state()["prompt_cache"]["bytes"] <= budget


def test_reset_and_sleep_drop_the_cache(weights):
    engine = _engine(weights)
    prefills = Prefills(engine)
    engine.generate([LONG, SHORT], PARAMS)
    state = engine.batch_state()["prompt_cache"]
    held = state["bytes"]
    assert engine.reset_prefix_cache() == {
        "cached_prefixes": state["entries"],
        "bytes_released": held,
    }
    engine.generate([LONG, SHORT], PARAMS)
    assert prefills.since(2) == 2
    assert engine.sleep(1)["prompt_cache_bytes_released"] == held
    engine.generate([LONG, SHORT], PARAMS)
    assert prefills.since(4) == 2


def _turn(prompt: list[int], output: dict, observation: list[int]) -> list[int]:
    """A multi-turn rollout's next prompt: this one, the sampled completion, then new tokens."""
    return prompt + output["token_ids"] + observation


@pytest.mark.parametrize("microbatch", [16384, 8], ids=["one-forward", "a-forward-each"])
def test_a_prompt_that_extends_a_cached_one_prefills_only_its_new_tokens(
    weights, uncached, microbatch
):
    """A multi-turn rollout's next turn starts with the last turn's prompt: that start is copied
    from the cache and only the rest goes through the model; from the third turn on the last
    turn's completion is cached too. Two extensions of different lengths, beside different
    reused lengths, share one prefill forward, or (a microbatch of 8 tokens) take one each."""
    engine = _engine(weights, max_tokens_per_microbatch=microbatch)
    prefills = Prefills(engine)
    first = [LONG, list(range(50, 70))]
    params = dict(PARAMS, n=1, ignore_eos=True)
    outputs = engine.generate(first, params)
    second = [_turn(first[0], outputs[0], [3, 4]), _turn(first[1], outputs[1], [9] * 7)]
    expected = uncached.generate(second, PARAMS)
    _poison(engine)
    seen = len(prefills.widths)
    _same(engine.generate(second, PARAMS), expected)
    width = params["max_tokens"] + 7  # the longest new run, for every forward of the admission
    assert prefills.widths[seen:] == [width] * (1 if microbatch >= 2 * width else 2)
    state = engine.batch_state()["prompt_cache"]
    assert (state["prefix_hits"], state["hits"]) == (2, 0)
    assert state["hit_tokens"] == len(first[0]) + len(first[1])
    # The second turn continued the first, so its finished sequences were cached as the starts
    # of a third (prompt and tokens but the last): only the last token and the observation go
    # through the model; an exact repeat of a second-turn prompt is a hit.
    third = [_turn(second[0], expected[0], [5]), second[1]]
    seen = len(prefills.widths)
    _same(engine.generate(third, PARAMS), uncached.generate(third, PARAMS))
    assert prefills.widths[seen:] == [1 + 1]
    # A finished sequence sent back as it is: a hit, its logits those its last token came from.
    back = [*second[1], *expected[-1]["token_ids"][:-1]]
    seen = len(prefills.widths)
    _same(engine.generate([back], PARAMS), uncached.generate([back], PARAMS))
    assert prefills.widths[seen:] == []


@pytest.mark.parametrize("microbatch", [16384, 8], ids=["one-forward-a-kind", "a-forward-each"])
def test_prefix_hits_beside_hits_and_misses_in_a_reused_cache(weights, uncached, microbatch):
    """One admission with each kind: copied whole, copied in part and the rest prefilled, and
    prefilled whole, in a prefix store wider than the prefix hits (a wider miss); KV buffers
    poisoned first, so every column each reads must be written."""
    engine = _engine(weights, max_tokens_per_microbatch=microbatch)
    prefills = Prefills(engine)
    middle = list(range(60, 85))
    engine.generate([LONG, SHORT, middle], PARAMS)
    wide = [50 + (i * 7) % 45 for i in range(60)]
    prompts = [[*LONG, 1, 2, 3], wide, SHORT, [*middle, 9, 9, 9, 9, 9], OTHER]
    _poison(engine)
    seen = len(prefills.widths)
    _same(engine.generate(prompts, PARAMS), uncached.generate(prompts, PARAMS))
    each = 1 if microbatch > len(wide) else 2  # forwards per kind: 2 prompts of each
    assert prefills.widths[seen:] == [len(wide)] * each + [5] * each
    state = engine.batch_state()["prompt_cache"]
    assert (state["hits"], state["prefix_hits"], state["misses"]) == (1, 2, 5)


def test_prefixes_match_a_whole_block_at_least_and_leave_a_token_to_prefill(weights, uncached):
    """A prompt that shares a start of a block or more with a cached one reuses all it shares;
    one that is the start of a cached one reuses all but its last token (its logits come from a
    forward); fewer shared tokens than a block reuse nothing."""
    engine = _engine(weights)
    prefills = Prefills(engine)
    engine.generate([LONG], PARAMS)
    diverging = [*LONG[: BLOCK + 5], 99, 98, 97]
    start_of = LONG[: 2 * BLOCK]
    short_share = [*LONG[: BLOCK - 1], 99]
    for prompt, width in ((diverging, 3), (start_of, 1), (short_share, BLOCK)):
        _same(engine.generate([prompt], PARAMS), uncached.generate([prompt], PARAMS))
        assert prefills.widths[-1] == width
    state = engine.batch_state()["prompt_cache"]
    assert (state["prefix_hits"], state["misses"]) == (2, 2)


def test_an_evicted_or_reset_prompt_is_no_prefix_any_more(weights):
    engine = _engine(weights)
    engine.generate([LONG], ONE_TOKEN)
    one = engine.batch_state()["prompt_cache"]["bytes"]
    engine = _engine(weights, prompt_cache_bytes=one)
    prefills = Prefills(engine)
    other = list(range(60, 100))  # as long as LONG: its entry takes LONG's place
    engine.generate([LONG], ONE_TOKEN)
    engine.generate([other], ONE_TOKEN)
    engine.generate([[*LONG, 1]], ONE_TOKEN)
    assert prefills.widths[-1] == len(LONG) + 1
    engine.generate([[*other, 1]], ONE_TOKEN)
    assert prefills.widths[-1] == 1
    engine.reset_prefix_cache()
    engine.generate([[*other, 1, 2]], ONE_TOKEN)
    assert prefills.widths[-1] == len(other) + 2


def test_a_block_hash_that_collides_is_checked_against_the_tokens(weights, uncached, monkeypatch):
    """Every block hashing alike makes every cached prompt a candidate: only one whose tokens
    match is used."""
    monkeypatch.setattr(prompt_cache, "_chain", lambda tokens, blocks: [0] * blocks)
    engine = _engine(weights)
    prefills = Prefills(engine)
    engine.generate([LONG], PARAMS)
    other = list(range(60, 100))
    _same(engine.generate([other], PARAMS), uncached.generate([other], PARAMS))
    assert prefills.widths[-1] == len(other)
    extended = [*LONG, 4]
    _same(engine.generate([extended], PARAMS), uncached.generate([extended], PARAMS))
    assert prefills.widths[-1] == 1


def test_only_a_call_that_continues_a_cached_prompt_has_its_sequences_cached(weights):
    """A call whose prompt extends a whole cached one (a next turn) has its finished sequences
    cached as the starts of the turn after; a call that continues nothing (single-turn work,
    or a prompt sharing only part of an entry, as a system prompt) has none cached."""
    engine = _engine(weights)
    cached = engine._prompt_cache._entries
    stem = list(range(60, 80))
    engine.generate([LONG], PARAMS)
    engine.generate([stem], ONE_TOKEN)
    engine.generate([[*LONG[:BLOCK], 99, 98]], PARAMS)  # shares part of LONG's entry
    assert len(cached) == 3  # the prompts only
    turn = [*stem, 1, 2]
    outputs = engine.generate([turn], PARAMS)
    assert set(cached) == {
        tuple(LONG),
        tuple(stem),
        (*LONG[:BLOCK], 99, 98),
        tuple(turn),
        *_fed([turn], outputs, PARAMS["n"]),
    }


def test_each_output_says_how_many_prompt_tokens_the_cache_provided(weights):
    """``cached_prompt_tokens``: what Tinker's ``prompt_cache_hit_tokens`` and OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` report; the same for every sample of a prompt."""
    engine = _engine(weights)
    n = PARAMS["n"]
    first = engine.generate([LONG, SHORT], PARAMS)
    assert [o["cached_prompt_tokens"] for o in first] == [0] * 2 * n
    diverging = [*LONG[: BLOCK + 5], 99, 98, 97]  # shares a block and five tokens with LONG
    again = engine.generate([LONG, diverging, OTHER], PARAMS)
    expected = [len(LONG)] * n + [BLOCK + 5] * n + [0] * n
    assert [o["cached_prompt_tokens"] for o in again] == expected
