"""Post-processors: named steps that turn a model call's logits into per-token quantities.

Clients name them in ``processing.post`` (verl sends ``["apply_temperature",
"compute_entropy_and_logprobs"]`` for updates and ``["compute_entropy_and_logprobs"]`` for
log-probs; the Cortex ``grpo`` contract sends ``["compute_logprobs"]``). They run in the order
given on a :class:`ScoringState` that holds the logits in the model's layout;
:mod:`arctic_platform.engine.forward` maps the results back to the batch's position-indexed
``[B, S]`` layout. If no step produced log-probs, they are computed at the end, because every loss
and every ``forward`` needs them. The logits are a
:class:`~arctic_platform.engine.logprobs.Logits`: the whole tensor, or the LM head applied in
chunks (:mod:`arctic_platform.engine.chunked_head`); the steps read them only through it, so
every step works on both.

The names, the default steps (``DEFAULT_POST``: temperature, then log-probs) and the check of a
request's names are the contract's (:mod:`arctic_platform.contract.processing`, torch-free, so a
server refuses an unknown name without importing torch); this module registers the code under
them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from arctic_platform.contract.processing import (
    APPLY_TEMPERATURE,
    ENTROPY_AND_LOGPROBS,
    IDENTITY,
    LOGPROBS,
    POST_PROCESSOR_NAMES,
)
from arctic_platform.engine.logprobs import Logits


@dataclass
class ScoringState:
    """One model call's outputs while post-processors run (model layout ``[r, T]``).

    ``targets[r, t]`` is the token that the output at ``(r, t)`` must score; ``logprobs`` and
    ``entropy`` are filled in the same layout, and ``top`` (the ``top_k`` likeliest tokens'
    ``(logprobs, token_ids)`` under the final logits) when ``top_k`` asks for it.
    """

    logits: Logits
    targets: torch.Tensor
    temperature: float
    want_entropy: bool
    top_k: int = 0
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    top: tuple[torch.Tensor, torch.Tensor] | None = None


PostProcessor = Callable[[ScoringState], None]
POST_PROCESSORS: dict[str, PostProcessor] = {}


def register_post_processor(name: str) -> Callable[[PostProcessor], PostProcessor]:
    """Register a post-processor under ``name`` (the name clients put in ``processing.post``);
    the contract's registry learns the name too."""

    def decorate(fn: PostProcessor) -> PostProcessor:
        POST_PROCESSORS[name] = fn
        POST_PROCESSOR_NAMES.add(name)
        return fn

    return decorate


@register_post_processor(IDENTITY)
def identity(state: ScoringState) -> None:
    """Leave the outputs as they are (the reference server accepts this name)."""


@register_post_processor(APPLY_TEMPERATURE)
def apply_temperature(state: ScoringState) -> None:
    """Divide the logits by ``meta.temperature`` (the sampler's temperature), unless it is 1.

    The division happens in float32: scaling bf16 logits in bf16 would round them before the
    log-softmax and bias the PPO ratios.
    """
    if state.temperature != 1.0:
        state.logits = state.logits.divided(state.temperature)
        state.top = None  # taken from the logits before the division


# The step verl names for log-probs and entropies; naming it in ``processing.post`` is also one of
# the older spellings of an entropy request (see :func:`arctic_platform.engine.meta.parse_request`).
@register_post_processor(ENTROPY_AND_LOGPROBS)
def compute_entropy_and_logprobs(state: ScoringState) -> None:
    """Target log-probs, and entropies when they were asked for or a loss needs them (and the
    top-k tokens when asked, from the same pass over the logits)."""
    scores = state.logits.scores(state.targets, want_entropy=state.want_entropy, top_k=state.top_k)
    state.logprobs, state.entropy, state.top = scores.logprobs, scores.entropy, scores.top


# The Cortex contract's name for the same step: log-probs of the logits as they are (no
# temperature unless a step before it applied one).
register_post_processor(LOGPROBS)(compute_entropy_and_logprobs)


def run_post_processors(names: tuple[str, ...], state: ScoringState) -> None:
    """Run ``names`` in order, then compute log-probs if no step did (and the top-k tokens of
    the final logits when asked and not computed with them)."""
    for name in names:
        POST_PROCESSORS[name](state)
    if state.logprobs is None:
        compute_entropy_and_logprobs(state)
    if state.top_k and state.top is None:
        state.top = state.logits.top(state.top_k)
