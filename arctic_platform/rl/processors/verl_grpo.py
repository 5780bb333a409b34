"""The ``verl_grpo`` loss under its earlier import path (a compatibility re-export).

It lives in :mod:`arctic_platform.integrations.verl.grpo_loss` (verl-shaped entry points) on top of
the engine's loss registry; every name here is the same object as there. Send
``processing={"loss_fn": LOSS_NAME}`` to have the server apply it.
"""

from __future__ import annotations

from arctic_platform.integrations.verl.grpo_loss import (
    AGG_MODES,
    KL_TYPES,
    LOSS_NAME,
    ActorLossConfig,
    VerlGrpoLoss,
    agg_loss,
    kl_penalty,
    kl_penalty_forward,
    parse_actor_config,
    verl_grpo_loss,
)

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "LOSS_NAME",
    "ActorLossConfig",
    "VerlGrpoLoss",
    "agg_loss",
    "kl_penalty",
    "kl_penalty_forward",
    "parse_actor_config",
    "verl_grpo_loss",
]
