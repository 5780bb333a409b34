"""The sampler's token-choice math against plainly written formulas, on synthetic logits."""

import math

import torch

from arctic_platform.engine.sampling_ops import (
    choose_tokens,
    draw,
    filtered_probs,
    seed_to_int64,
    sequence_keys,
    step_uniforms,
)


def _support_by_formula(probs, top_k, top_p, min_p):
    """The allowed tokens of one row, written the slow obvious way."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    allowed = set(order[:top_k]) if top_k > 0 else set(order)
    if top_p < 1.0:
        mass = sum(probs[i] for i in allowed)
        kept, cumulative = set(), 0.0
        for i in order:
            if i not in allowed:
                continue
            if cumulative < top_p * mass:
                kept.add(i)
            cumulative += probs[i]
        allowed = kept
    if min_p > 0:
        largest = max(probs)
        allowed = {i for i in allowed if probs[i] >= min_p * largest}
    return allowed


def test_filters_match_the_formula():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen) * 2
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.tensor([-1, 5, -1, -1, 8, 3])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.6, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.1, 0.0])
    out = filtered_probs(probs, top_k, top_p, min_p)
    for row in range(6):
        expected = _support_by_formula(
            probs[row].tolist(), int(top_k[row]), float(top_p[row]), float(min_p[row])
        )
        assert set(out[row].nonzero().flatten().tolist()) == expected
        kept = sorted(expected)
        assert torch.equal(out[row, kept], probs[row, kept])
    assert torch.equal(out[0], probs[0])  # no filter: bit-identical


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.3, 0.6, 0.0])
    count = 20000
    u = step_uniforms(sequence_keys(torch.full((count,), 7), torch.arange(count)), 0)
    tokens = draw(probs.expand(count, -1), u)
    freq = torch.bincount(tokens, minlength=5).double() / count
    assert freq[1] == 0 and freq[4] == 0
    # Binomial standard error at n=20000 is <= 0.0035; 5 sigma.
    assert torch.allclose(freq, probs.double(), atol=0.018)


def test_draw_never_picks_zero_probability_even_at_u_close_to_one():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert draw(probs, torch.tensor([1.0 - 2**-24])).item() == 1
    assert draw(probs, torch.tensor([0.0])).item() == 0


def test_uniforms_are_per_sequence_and_reproducible():
    seeds = torch.tensor([seed_to_int64(s) for s in (1, 2, 3, 2**70 + 5)])
    keys = sequence_keys(seeds, torch.tensor([0, 0, 0, 1]))
    u = step_uniforms(keys, 4)
    # A row's value does not depend on the other rows: permute and subset.
    assert torch.equal(step_uniforms(keys.flip(0), 4), u.flip(0))
    assert torch.equal(step_uniforms(keys[2:3], 4), u[2:3])
    assert ((u >= 0) & (u < 1)).all()
    assert not torch.equal(step_uniforms(keys, 5), u)  # steps differ
    many = step_uniforms(
        sequence_keys(torch.zeros(50000, dtype=torch.long), torch.arange(50000)), 0
    )
    assert abs(many.mean().item() - 0.5) < 0.005
    assert abs(many.var().item() - 1 / 12) < 0.002
    assert len(set(many.tolist())) > 49000


def test_choose_tokens_greedy_temperature_and_suppression():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    tokens, scaled = choose_tokens(
        logits,
        greedy=torch.tensor([True, False, True]),
        temperature=torch.tensor([0.0, 0.5, 0.0]),
        top_k=torch.tensor([-1, 1, -1]),
        top_p=torch.ones(3),
        min_p=torch.zeros(3),
        uniforms=torch.tensor([0.3, 0.9, 0.1]),
        suppress=torch.tensor([[False] * 3, [False] * 3, [False, False, True]]),
    )
    assert tokens.tolist() == [1, 1, 0]  # greedy; top-1 sampling; greedy with token 2 suppressed
    assert torch.equal(scaled[0], logits[0])  # greedy rows: T = 1
    assert torch.equal(scaled[1], logits[1] / 0.5)
    assert math.isfinite(scaled[2, 2].item())  # log-probs are taken before suppression
