"""Token log-probabilities and entropies from logits, in float32.

Everything that scores tokens (training losses, ``fwd_no_grad``, the reference model, the
``log-probs`` op) goes through these functions so the numbers agree to the last bit wherever they
are computed. Logits are upcast to float32 first: bf16 log-softmax loses enough precision to bias
PPO ratios.

The functions work on any leading shape ``[..., V]``; callers decide which positions the result
belongs to (see :mod:`arctic_platform.engine.forward` for the position-indexed layout).
:class:`DenseLogits` applies them to a model call's whole logits; the chunked LM head
(:mod:`arctic_platform.engine.chunked_head`) computes the same quantities without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` at every position, float32, shape ``logits.shape[:-1]``.

    Computed as ``logit[target] - logsumexp(logits)`` so no full ``[..., V]`` log-softmax tensor is
    kept for backward beyond what ``logsumexp`` itself needs.
    """
    logits = logits.float()
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs and the entropy of each position's distribution, both float32.

    Entropy ``H = lse - sum(softmax * logits)`` shares the log-sum-exp with the log-prob, so asking
    for both costs one extra softmax pass rather than a second log-softmax.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    probs = torch.exp(logits - lse.unsqueeze(-1))
    entropy = lse - (probs * logits).sum(-1)
    return picked - lse, entropy


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest tokens at each position: ``(logprobs, token_ids)``, each ``[..., k]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, k, dim=-1)
    return values, ids


@dataclass(frozen=True)
class TokenScores:
    """What a model call scores, in the model layout ``[r, T]``: the targets' log-probs, the
    entropies and the top-``k`` ``(logprobs, token_ids)`` (each None unless asked)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    top: tuple[torch.Tensor, torch.Tensor] | None = None


class Logits(Protocol):
    """A model call's logits, whole (:class:`DenseLogits`) or computed on demand through the LM
    head in chunks (:class:`~arctic_platform.engine.chunked_head.ChunkedLogits`)."""

    def divided(self, temperature: float) -> Logits:
        """These logits divided by ``temperature``, in float32."""
        ...

    def scores(self, targets: torch.Tensor, *, want_entropy: bool, top_k: int) -> TokenScores:
        """The targets' log-probs (+ entropies, + top-``k`` when ``top_k``)."""
        ...

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-``k`` ``(logprobs, token_ids)`` at every position."""
        ...


@dataclass(frozen=True)
class DenseLogits:
    """A model call's whole ``[r, T, V]`` logits, scored by the functions above."""

    logits: torch.Tensor

    def divided(self, temperature: float) -> DenseLogits:
        # In float32: scaling bf16 logits in bf16 would round them before the log-softmax.
        return DenseLogits(self.logits.float() / temperature)

    def scores(self, targets: torch.Tensor, *, want_entropy: bool, top_k: int) -> TokenScores:
        entropy = None
        if want_entropy:
            logprobs, entropy = token_logprobs_and_entropy(self.logits, targets)
        else:
            logprobs = token_logprobs(self.logits, targets)
        return TokenScores(logprobs, entropy, self.top(top_k) if top_k else None)

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_logprobs(self.logits, k)
