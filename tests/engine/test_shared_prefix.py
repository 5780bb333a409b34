"""Shared-prefix decode attention: each prompt's keys and values held and read once for all its
samples (:mod:`arctic_platform.engine.shared_prefix`).

The attention function is checked against torch's own scaled-dot-product attention over each row's
plain concatenation of its prompt and its completion; the engine is checked for what the layout
buys (all ``n`` samples of a long prompt fit a budget that ``n`` copies would not) and for the
clear error when a model does not pass the layout down to its attention.
"""

import pytest
import torch

from arctic_platform.engine import sampler
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.errors import UnsupportedModel
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.shared_prefix import layout, shared_prefix_attention

HEADS, KV_HEADS, DIM = 8, 2, 16


def _bias(start: list[int], columns: int) -> torch.Tensor:
    visible = torch.arange(columns)[None, :] >= torch.tensor(start)[:, None]
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]


def _reference(query, prefix_k, prefix_v, prefix_start, suffix_k, suffix_v, suffix_start, group):
    """Each row alone: its group's prompt columns from its start, then its own completion."""
    outs = []
    for r, g in enumerate(group):
        p, s = prefix_start[g], suffix_start[r]
        keys = torch.cat([prefix_k[g, :, p:], suffix_k[r, :, s:]], 1)
        values = torch.cat([prefix_v[g, :, p:], suffix_v[r, :, s:]], 1)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[r : r + 1], keys[None], values[None], enable_gqa=True
            )
        )
    return torch.cat(outs).transpose(1, 2)  # [rows, 1, heads, dim]


@pytest.mark.parametrize(
    ("group", "path"),
    [
        # two prompts, four samples each, in order: no scatter or gather
        ([0, 0, 0, 0, 1, 1, 1, 1], "dense"),
        # three prompts with 2, 2 and 3 rows left, interleaved: padded chunks, scattered rows
        ([0, 1, 0, 2, 2, 1, 2], "padded"),
        # one prompt with 6 rows among four with 1: padding to 6 would be 30 slots for 10 rows,
        # so a first level takes one row of each prompt and a second the large one's other 5
        ([0, 1, 0, 2, 0, 3, 0, 0, 4, 0], "levels"),
        # sizes 1, 2, 3 and 9: a level of 2 rows per prompt, then one of 7 for the two larger
        ([3, 0, 1, 1, 2, 2, 2] + [3] * 8, "levels"),
    ],
)
def test_attention_equals_each_row_over_its_own_prompt_and_completion(group, path):
    gen = torch.Generator().manual_seed(0)
    groups, rows, width, capacity = max(group) + 1, len(group), 12, 5
    prefix_start = [0, 4, 9, 2, 11][:groups]  # left padding of the shorter prompts
    suffix_start = [(r * 2) % capacity for r in range(rows)]  # rows that joined later

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    query = rand(rows, HEADS, 1, DIM)
    prefix_k, prefix_v = rand(groups, KV_HEADS, width, DIM), rand(groups, KV_HEADS, width, DIM)
    suffix_k, suffix_v = rand(rows, KV_HEADS, capacity, DIM), rand(rows, KV_HEADS, capacity, DIM)
    step = layout(
        torch.tensor(group),
        groups,
        lambda layer: (prefix_k, prefix_v),
        prefix_bias=_bias([prefix_start[g] for g in group], width),
        suffix_bias=_bias(suffix_start, capacity),
    )
    levels = step.levels
    taken = "levels" if len(levels) > 1 else "dense" if levels[0].dense else "padded"
    assert taken == path
    assert sum(level.chunks * level.per_chunk for level in levels) <= 2 * rows
    out, weights = shared_prefix_attention(query, suffix_k, suffix_v, prefix_k, prefix_v, step)
    expected = _reference(
        query, prefix_k, prefix_v, prefix_start, suffix_k, suffix_v, suffix_start, group
    )
    assert weights is None and out.shape == (rows, 1, HEADS, DIM)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_scores_are_float32():
    """Half-precision keys and queries score in float32 (as fused attention does): the result is
    as close to a float64 reference as bfloat16 SDPA's, not the twice-larger error of rounding
    the scores to bfloat16 before the softmax."""
    gen = torch.Generator().manual_seed(1)
    rows, width, capacity = 8, 400, 3
    query = torch.randn(rows, HEADS, 1, DIM, generator=gen) * 3
    prefix_k = torch.randn(1, KV_HEADS, width, DIM, generator=gen) * 3
    prefix_v = torch.randn(1, KV_HEADS, width, DIM, generator=gen)
    suffix_k = torch.randn(rows, KV_HEADS, capacity, DIM, generator=gen) * 3
    suffix_v = torch.randn(rows, KV_HEADS, capacity, DIM, generator=gen)
    group = [0] * rows
    step = layout(torch.tensor(group), 1, None, None, None)
    half = [t.bfloat16() for t in (query, suffix_k, suffix_v, prefix_k, prefix_v)]
    out, _ = shared_prefix_attention(*half, step)
    exact = _reference(
        *(t.double() for t in (query, prefix_k, prefix_v)),
        [0],
        suffix_k.double(),
        suffix_v.double(),
        [0] * rows,
        group,
    )
    fused = _reference(half[0], half[3], half[4], [0], half[1], half[2], [0] * rows, group)
    ours_error = (out.double() - exact).abs().mean()
    fused_error = (fused.double() - exact).abs().mean()
    assert ours_error <= 1.25 * fused_error


@pytest.fixture(scope="module")
def engine_for_one_prompt_and_eight_rows():
    """A budget for one 200-token prompt plus 8 completions of 16 tokens, far below 8 copies of
    the prompt (8 x 216 tokens): rows that each held the prompt would decode in waves of 2."""
    probe = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))
    per_token = probe._kv_bytes_per_token()
    budget = (200 + 8 * 16) * per_token
    return SamplingEngine(
        SamplingEngineConfig(model=ModelConfig(name="builtin:tiny"), max_kv_cache_bytes=budget)
    )


def test_all_samples_of_a_prompt_decode_together_in_a_budget_for_one_copy(
    engine_for_one_prompt_and_eight_rows,
):
    engine = engine_for_one_prompt_and_eight_rows
    rows_per_forward = []
    hook = engine.model.get_input_embeddings().register_forward_hook(
        lambda _module, args, _out: rows_per_forward.append(tuple(args[0].shape))
    )
    try:
        outs = engine.generate(["x" * 200], {"n": 8, "max_tokens": 16, "min_tokens": 16, "seed": 3})
    finally:
        hook.remove()
    assert [len(o["token_ids"]) for o in outs] == [16] * 8
    assert rows_per_forward == [(1, 200)] + [(8, 1)] * 15  # one prefill, one batch of 8 rows


def test_a_model_that_drops_attention_keywords_is_refused_by_name():
    engine = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))
    attention = engine.model.model.layers[1].self_attn
    forward = attention.forward

    def without_keywords(hidden_states, position_embeddings, attention_mask, **kwargs):
        kwargs.pop("shared_prefix", None)
        return forward(hidden_states, position_embeddings, attention_mask, **kwargs)

    attention.forward = without_keywords
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM .*3 of 4 layers"):
        engine.generate(["hello"], {"max_tokens": 4, "seed": 0})


def test_a_model_whose_attention_uses_softcap_is_refused_by_name():
    engine = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))
    attention = engine.model.model.layers[0].self_attn
    forward = attention.forward

    def with_softcap(hidden_states, position_embeddings, attention_mask, **kwargs):
        return forward(hidden_states, position_embeddings, attention_mask, softcap=30.0, **kwargs)

    attention.forward = with_softcap
    with pytest.raises(UnsupportedModel, match="LlamaAttention passes softcap to its attention"):
        engine.generate(["hello"], {"max_tokens": 4, "seed": 0})


def test_a_flash_attention_model_prefills_with_sdpa_and_samples_the_same(monkeypatch):
    """transformers resolves flash-attention (and paged, hub-kernel) implementations by their
    exact name, so the sampler's wrapper keeps ``sdpa`` for prefill instead (the flash setting
    is written into the loaded model's config directly: this machine has no flash_attn)."""
    params = {"temperature": 0, "max_tokens": 12, "n": 2}
    prompts = ["hello world", "a"]
    expected = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))

    def flash_loaded(*args, **kwargs):
        model = load_causal_lm(*args, **kwargs)
        model.config._attn_implementation = "flash_attention_2"
        return model

    monkeypatch.setattr(sampler, "load_causal_lm", flash_loaded)
    engine = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))
    assert engine.model.config._attn_implementation == "shared_prefix_sdpa"
    assert [o["token_ids"] for o in engine.generate(prompts, params)] == [
        o["token_ids"] for o in expected.generate(prompts, params)
    ]


def test_the_cache_stays_within_its_budget_when_prompts_and_completions_trade_places():
    """One long prompt, then many long completions: the prefix and suffix stores share each
    layer's buffer, so the pool never holds more than the budget."""
    probe = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))
    budget = 512 * probe._kv_bytes_per_token()
    engine = SamplingEngine(
        SamplingEngineConfig(
            model=ModelConfig(name="builtin:tiny"), max_kv_cache_bytes=budget, max_batch_size=64
        )
    )
    params = {"temperature": 0, "ignore_eos": True}
    engine.generate([[5] * 500], {**params, "max_tokens": 12})
    assert engine._pool.nbytes <= budget
    engine.generate([[5, 6]], {**params, "max_tokens": 62, "n": 8})
    assert engine._pool.nbytes <= budget


def test_a_model_whose_attention_takes_no_extra_keywords_is_refused_by_name():
    engine = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))
    attention = engine.model.model.layers[2].self_attn
    forward = attention.forward

    def fixed(
        hidden_states,
        position_embeddings,
        attention_mask,
        past_key_values=None,
        position_ids=None,
        use_cache=None,
    ):
        return forward(
            hidden_states,
            position_embeddings,
            attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
            use_cache=use_cache,
        )

    attention.forward = fixed
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM .*0 of 4 layers"):
        engine.generate(["hello"], {"max_tokens": 4, "seed": 0})
