"""The ``verl_grpo`` loss (verl's PPO-clip actor loss), re-exported from where it lives.

Its home is the engine's loss registry (:mod:`arctic_platform.engine.losses.verl_grpo`); the verl
integration may move it to ``arctic_platform.integrations.verl.grpo_loss``. Both work: the
integration's module is used when it exists. Send ``processing={"loss_fn": LOSS_NAME}`` to have
the server apply it.
"""

from __future__ import annotations

import importlib

from arctic_platform._extras import require

require("torch", "engine", purpose="the verl_grpo loss")

LOSS_NAME = "verl_grpo"
_INTEGRATION_HOME = "arctic_platform.integrations.verl.grpo_loss"

try:
    _home = importlib.import_module(_INTEGRATION_HOME)
except ModuleNotFoundError as exc:
    if exc.name not in (_INTEGRATION_HOME, "arctic_platform.integrations.verl"):
        raise
    _home = importlib.import_module("arctic_platform.engine.losses.verl_grpo")

ActorLossConfig = _home.ActorLossConfig
VerlGrpoLoss = _home.VerlGrpoLoss
parse_actor_config = _home.parse_actor_config

__all__ = ["LOSS_NAME", "ActorLossConfig", "VerlGrpoLoss", "parse_actor_config"]
