"""What a loss is, and the registry that finds one by name.

A loss is registered as a *factory*: ``factory(batch, meta, config) -> PreparedLoss``. The factory
runs once per request, before any model or optimizer state changes; it checks the fields and knobs
the loss needs (raising :class:`EngineInputError` naming the culprit), binds the global counts, and
returns a :class:`PreparedLoss`. The engine then calls the prepared loss once per microbatch with
the model outputs and the rows of :attr:`PreparedLoss.tensors` that microbatch covers. A prepared
loss is a pure function of those inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from arctic_platform.contract.processing import LOSS_NAMES
from arctic_platform.engine.batching import Batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.meta import Meta

Metrics = dict[str, "torch.Tensor | float"]


@dataclass(frozen=True)
class LossOutput:
    """One microbatch's loss and metrics.

    ``loss`` is this microbatch's share of the global objective (already scaled by ``dp_size``), so
    the engine back-propagates it as is. ``metrics`` holds ``name.sum``/``name.tokens`` pairs
    (reduced to global token means) and plain numbers (averaged).
    """

    loss: torch.Tensor
    metrics: Metrics


class PreparedLoss(Protocol):
    """A loss bound to one request (see module doc)."""

    #: Whether the model outputs must include per-token entropy.
    needs_entropy: bool
    #: ``[B, S]`` token to score at each position, or None for ``input_ids``.
    targets: torch.Tensor | None
    #: ``[B, ...]`` tensors the loss reads; the engine passes each microbatch's rows of them.
    tensors: dict[str, torch.Tensor]
    #: ``[B, S]`` bool: the positions whose outputs the loss reads. Outputs elsewhere may hold
    #: anything (:func:`masked`); the chunked LM head does not compute them for a backward pass.
    reads: torch.Tensor

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]
    ) -> LossOutput: ...


LossFactory = Callable[[Batch, Meta, Mapping[str, Any]], PreparedLoss]
LOSSES: dict[str, LossFactory] = {}


def register_loss(name: str) -> Callable[[LossFactory], LossFactory]:
    """Register a loss factory under ``name`` (the name clients send as ``processing.loss_fn``);
    the contract's registry learns the name too, so the server's edge accepts it."""

    def decorate(factory: LossFactory) -> LossFactory:
        LOSSES[name] = factory
        LOSS_NAMES.add(name)
        return factory

    return decorate


def get_loss(name: str) -> LossFactory:
    """The factory registered as ``name``; an unknown name is an input error."""
    try:
        return LOSSES[name]
    except KeyError:
        known = ", ".join(sorted(LOSSES))
        raise EngineInputError(
            "processing.loss_fn", f"unknown loss {name!r}; known: {known}"
        ) from None


def token_mask(batch: Batch, loss: str) -> tuple[str, torch.Tensor]:
    """The mask of tokens an RL loss trains on: ``loss_mask`` if sent, else ``response_mask``."""
    name = "loss_mask" if batch.has("loss_mask") else "response_mask"
    mask = batch.require(name, f"the {loss} loss needs loss_mask or response_mask")
    batch.check_loss_mask(name, mask)
    return name, mask


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is set, 0 elsewhere: positions outside the mask may hold anything
    (NaN included), and none of it may reach autograd."""
    return torch.where(mask, values, torch.zeros((), device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values)`` over ``mask``, detached, for metric ``.sum`` entries."""
    return masked(values.detach(), mask).sum()


# processing.config.old_log_probs value that asks for the on-policy form of a policy loss.
CURRENT_POLICY = "current"


def policy_tensors(batch: Batch, config: Mapping[str, Any], loss: str) -> list[str]:
    """The batch fields a policy-ratio loss reads: ``advantages``, and ``old_log_probs`` unless
    the ratio is taken against the current policy.

    The **on-policy form**: with ``processing.config.old_log_probs: "current"``, or when the batch
    carries no ``old_log_probs``, the ratio's old log-probs are the current log-probs, detached.
    That is exactly what a separate ``fwd_no_grad`` just before the update would return, so a
    batch that gets one update needs no such pass (TRL's GRPOTrainer does the same). With several
    updates per batch the old log-probs must come from before the first one: send them.
    """
    batch.require("advantages", f"the {loss} loss needs it")
    mode = config.get("old_log_probs")
    if mode is not None and mode != CURRENT_POLICY:
        raise EngineInputError(
            "processing.config.old_log_probs",
            f"expected {CURRENT_POLICY!r} (ratio against the detached current log-probs) or "
            f"absent (use batch.old_log_probs), got {mode!r}",
        )
    if mode == CURRENT_POLICY or not batch.has("old_log_probs"):
        return ["advantages"]
    return ["advantages", "old_log_probs"]


def policy_ratio(
    logp: torch.Tensor, rows: Mapping[str, torch.Tensor], mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(advantages, log_ratio, ratio)`` of a policy loss's microbatch, over ``mask``.

    ``log_ratio = clamp(logp - old, -20, 20)`` (the clamp only guards ``exp`` against overflow)
    and ``ratio = exp(log_ratio)``; ``old`` is ``rows["old_log_probs"]``, or ``logp`` detached in
    the on-policy form (:func:`policy_tensors`), where the ratio is 1 and its gradient that of
    ``logp``.
    """
    advantages = masked(rows["advantages"], mask)
    old = rows["old_log_probs"] if "old_log_probs" in rows else logp.detach()
    log_ratio = torch.clamp(logp - masked(old, mask), min=-20.0, max=20.0)
    return advantages, log_ratio, torch.exp(log_ratio)


@dataclass(frozen=True)
class ClippedSurrogate:
    """PPO's clipped policy term per token, as the GRPO losses build on it: ``unclipped``
    ``-A r``, ``clipped`` ``-A clip(r, 1 - low, 1 + high)`` and ``loss`` their maximum, with the
    ``advantages``, ``log_ratio`` and ``ratio`` they came from (:func:`policy_ratio`)."""

    advantages: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    unclipped: torch.Tensor
    clipped: torch.Tensor
    loss: torch.Tensor


def clipped_surrogate(
    logp: torch.Tensor,
    rows: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
) -> ClippedSurrogate:
    """The clipped policy term of a microbatch (see :class:`ClippedSurrogate`)."""
    advantages, log_ratio, ratio = policy_ratio(logp, rows, mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return ClippedSurrogate(
        advantages, log_ratio, ratio, unclipped, clipped, torch.maximum(unclipped, clipped)
    )


def rollout_weighted(
    per_token: torch.Tensor, rows: Mapping[str, torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """``per_token`` times the batch's ``rollout_is_weights`` (rollout importance sampling), or
    as it is when the batch has none."""
    if "rollout_is_weights" not in rows:
        return per_token
    return per_token * masked(rows["rollout_is_weights"], mask)


def add_token_counts(metrics: Metrics, tokens: torch.Tensor) -> Metrics:
    """Give every ``name.sum`` metric its ``name.tokens`` pair: the token count it averages over."""
    for name in [k for k in metrics if k.endswith(".sum")]:
        metrics[name[: -len(".sum")] + ".tokens"] = tokens
    return metrics
