"""Shared-prefix decode attention: each prompt's keys and values held and read once for all its
samples (:mod:`arctic_platform.engine.shared_prefix`).

The attention function is checked against torch's own scaled-dot-product attention over each row's
plain concatenation of its prompt and its completion; the engine is checked for what the layout
buys (all ``n`` samples of a long prompt fit a budget that ``n`` copies would not) and for the
clear error when a model does not pass the layout down to its attention.
"""

import pytest
import torch

from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.errors import UnsupportedModel
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.shared_prefix import SharedPrefixStep, shared_prefix_attention

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
    ("group", "slots", "per_group", "dense"),
    [
        # two prompts, four samples each, in order: the dense path (no scatter)
        ([0, 0, 0, 0, 1, 1, 1, 1], list(range(8)), 4, True),
        # three prompts with 2, 2 and 3 rows left, interleaved: padded groups, scattered rows
        ([0, 1, 0, 2, 2, 1, 2], [0, 3, 1, 6, 7, 4, 8], 3, False),
    ],
    ids=["dense", "uneven-groups"],
)
def test_attention_equals_each_row_over_its_own_prompt_and_completion(
    group, slots, per_group, dense
):
    gen = torch.Generator().manual_seed(0)
    groups, rows, width, capacity = max(group) + 1, len(group), 12, 5
    prefix_start = [0, 4, 9][:groups]  # left padding of the shorter prompts
    suffix_start = [(r * 2) % capacity for r in range(rows)]  # rows that joined later

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    query = rand(rows, HEADS, 1, DIM)
    prefix_k, prefix_v = rand(groups, KV_HEADS, width, DIM), rand(groups, KV_HEADS, width, DIM)
    suffix_k, suffix_v = rand(rows, KV_HEADS, capacity, DIM), rand(rows, KV_HEADS, capacity, DIM)
    step = SharedPrefixStep(
        prefix=lambda layer: (prefix_k, prefix_v),
        slots=torch.tensor(slots),
        groups=groups,
        per_group=per_group,
        prefix_bias=_bias([prefix_start[g] for g in group], width),
        suffix_bias=_bias(suffix_start, capacity),
        dense=dense,
    )
    out, weights = shared_prefix_attention(query, suffix_k, suffix_v, prefix_k, prefix_v, step)
    expected = _reference(
        query, prefix_k, prefix_v, prefix_start, suffix_k, suffix_v, suffix_start, group
    )
    assert weights is None and out.shape == (rows, 1, HEADS, DIM)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


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
