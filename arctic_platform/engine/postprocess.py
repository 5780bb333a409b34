"""Post-processors: named steps that turn a model call's logits into per-token quantities.

Clients name them in ``processing.post`` (verl sends ``["apply_temperature",
"compute_entropy_and_logprobs"]`` for updates and ``["compute_entropy_and_logprobs"]`` for
log-probs; the Cortex ``grpo`` contract sends ``["compute_logprobs"]``). They run in the order
given on a :class:`ScoringState` that holds the logits in the model's layout;
:mod:`arctic_platform.engine.forward` maps the results back to the batch's position-indexed
``[B, S]`` layout. If no step produced log-probs, they are computed at the end, because every loss
and every ``forward`` needs them.

When ``processing.post`` is absent the default is :data:`DEFAULT_POST` (temperature, then
log-probs), so ``forward`` and ``forward_backward`` score tokens the same way unless a client says
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from arctic_platform.engine.logprobs import token_logprobs, token_logprobs_and_entropy


@dataclass
class ScoringState:
    """One model call's outputs while post-processors run (model layout ``[r, T]``).

    ``targets[r, t]`` is the token that the output at ``(r, t)`` must score; ``logprobs`` and
    ``entropy`` are filled in the same layout.
    """

    logits: torch.Tensor
    targets: torch.Tensor
    temperature: float
    want_entropy: bool
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


PostProcessor = Callable[[ScoringState], None]
POST_PROCESSORS: dict[str, PostProcessor] = {}


def register_post_processor(name: str) -> Callable[[PostProcessor], PostProcessor]:
    """Register a post-processor under ``name`` (the name clients put in ``processing.post``)."""

    def decorate(fn: PostProcessor) -> PostProcessor:
        POST_PROCESSORS[name] = fn
        return fn

    return decorate


@register_post_processor("identity")
def identity(state: ScoringState) -> None:
    """Leave the outputs as they are (the reference server accepts this name)."""


@register_post_processor("apply_temperature")
def apply_temperature(state: ScoringState) -> None:
    """Divide the logits by ``meta.temperature`` (the sampler's temperature), unless it is 1.

    The division happens in float32: scaling bf16 logits in bf16 would round them before the
    log-softmax and bias the PPO ratios.
    """
    if state.temperature != 1.0:
        state.logits = state.logits.float() / state.temperature


# The step verl names for log-probs and entropies; naming it in ``processing.post`` is also one of
# the older spellings of an entropy request (see :func:`arctic_platform.engine.meta.parse_request`).
ENTROPY_AND_LOGPROBS = "compute_entropy_and_logprobs"


@register_post_processor(ENTROPY_AND_LOGPROBS)
def compute_entropy_and_logprobs(state: ScoringState) -> None:
    """Target log-probs, and entropies when they were asked for or a loss needs them."""
    if state.want_entropy:
        state.logprobs, state.entropy = token_logprobs_and_entropy(state.logits, state.targets)
    else:
        state.logprobs = token_logprobs(state.logits, state.targets)


# The Cortex contract's name for the same step: log-probs of the logits as they are (no
# temperature unless a step before it applied one).
register_post_processor("compute_logprobs")(compute_entropy_and_logprobs)


DEFAULT_POST: tuple[str, ...] = ("apply_temperature", ENTROPY_AND_LOGPROBS)


def run_post_processors(names: tuple[str, ...], state: ScoringState) -> None:
    """Run ``names`` in order, then compute log-probs if no step did."""
    for name in names:
        POST_PROCESSORS[name](state)
    if state.logprobs is None:
        compute_entropy_and_logprobs(state)
