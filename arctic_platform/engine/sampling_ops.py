"""The per-step token choice of the sampler, on the whole batch at once.

Two properties drive the design:

**Randomness belongs to the sequence, not to the batch.** Each sequence owns a 64-bit key
(derived from the request's seed and the sample's index) and the uniform number it uses at decode
step ``t`` is a hash of ``(key, t)`` (SplitMix64, computed with int64 tensor ops). Nothing depends
on which other sequences share the batch or on how many random numbers they drew, so a seeded
request gives the same samples alone or in any batch, and no per-row Python generator is needed.

**One uniform per token, inverse-CDF over the vocabulary in its natural order.** Filters (top-k,
top-p, min-p) only zero probabilities; the draw always walks the vocabulary in id order. A row
without filters therefore samples exactly the same token whether or not another row in the batch
forced the sorted (filtering) path.

Log-probabilities returned to the caller are those of the temperature-scaled model distribution,
``log_softmax(logits / T)``, before min-tokens suppression and before top-k/top-p/min-p filtering
(greedy rows use ``T = 1``). That is what a trainer recomputes from the same logits, so rollout and
training log-probs agree. (vLLM returns the unscaled model log-probs by default; we differ on
purpose and say so.)
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser; int64 multiplication wraps modulo 2**64 as required."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def sequence_keys(seeds: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """The random-stream key of each sequence from its request seed and its sample index."""
    return _mix64(_mix64(seeds) + (sample_index + 1) * _GOLDEN)


def step_uniforms(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One float32 uniform in [0, 1) per sequence for decode step ``step`` (one step for all, or
    each sequence's own: sequences that joined a running batch later are at earlier steps)."""
    if isinstance(step, torch.Tensor):
        offset = (step + 1) * _GOLDEN  # int64 multiplication wraps as the int version's mask does
    else:
        offset = _signed((step + 1) * _GOLDEN)
    bits = _shift_right(_mix64(keys + offset), 40)  # top 24 bits
    return bits.to(torch.float32) * (1.0 / (1 << 24))


def seed_to_int64(seed: int) -> int:
    """Fold any Python int seed into the int64 range the hash works on."""
    return _signed(seed)


def filtered_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k / top-p / min-p support.

    ``top_k`` is ``[B]`` int (``<= 0`` = off), ``top_p`` and ``min_p`` are ``[B]`` floats.
    Top-p is taken on the top-k-renormalised distribution (the smallest set of most likely tokens
    whose mass reaches ``top_p``; the most likely token always stays); min-p keeps tokens whose
    probability is at least ``min_p`` times the largest (a ratio, so renormalising does not change
    it). Rows with every filter off are returned unchanged, bit for bit.
    """
    keep = torch.ones_like(probs, dtype=torch.bool)
    use_k, use_p = top_k > 0, top_p < 1.0
    if bool((use_k | use_p).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        keep_sorted = ~use_k[:, None] | (ranks[None, :] < top_k[:, None])
        if bool(use_p.any()):
            in_k = sorted_probs * keep_sorted
            mass_before = in_k.cumsum(dim=-1) - in_k
            threshold = top_p[:, None] * in_k.sum(dim=-1, keepdim=True)
            keep_sorted &= ~use_p[:, None] | (mass_before < threshold)
        keep = torch.zeros_like(keep).scatter_(-1, order, keep_sorted)
    if bool((min_p > 0).any()):
        largest = probs.max(dim=-1, keepdim=True).values
        keep &= probs >= min_p[:, None] * largest
    return probs * keep


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row, the token where the cumulative mass passes ``u``.

    Zero-probability tokens are never chosen: rounding can only push the draw past the end, and
    the result is clamped to the last token with positive probability.
    """
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    vocab = probs.shape[-1]
    last_positive = vocab - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(tokens, last_positive)


def choose_tokens(
    logits: torch.Tensor,
    *,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
    suppress: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return ``(tokens, scaled_logits)``.

    ``logits`` is ``[B, V]`` float32 from the model. ``suppress`` (``[B, V]`` bool or None) marks
    tokens that may not be chosen now (stop tokens before ``min_tokens``). ``scaled_logits`` is
    ``logits / T`` (``T = 1`` on greedy rows), unsuppressed, for the caller's log-probs.
    """
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / scale[:, None]
    allowed = scaled if suppress is None else scaled.masked_fill(suppress, float("-inf"))
    tokens = allowed.argmax(dim=-1)
    if not bool(greedy.all()):
        probs = filtered_probs(torch.softmax(allowed, dim=-1), top_k, top_p, min_p)
        tokens = torch.where(greedy, tokens, draw(probs, uniforms))
    return tokens, scaled
