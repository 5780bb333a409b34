"""Loss registry and the built-in losses.

Look a loss up by name with :func:`get_loss`; add one with :func:`register_loss`. Built-in:

* ``verl_grpo``: verl's PPO-clip actor loss with every knob from ``meta.actor_config``
  (:mod:`.verl_grpo`);
* ``grpo``: the Cortex GRPO contract, knobs from ``processing.config`` (:mod:`.cortex_grpo`),
  and ``grpo_echo_v1``, the same with ECHO's environment-prediction term
  (:mod:`.cortex_grpo_echo`);
* ``ppo``, ``importance_sampling``, ``cispo``, ``dro``: Tinker's policy losses (:mod:`.ppo`);
* ``cross_entropy``: supervised fine-tuning (:mod:`.cross_entropy`).
"""

from arctic_platform.engine.losses import (
    cortex_grpo,
    cortex_grpo_echo,
    cross_entropy,
    ppo,
    verl_grpo,
)
from arctic_platform.engine.losses.base import (
    LOSSES,
    LossFactory,
    LossOutput,
    PreparedLoss,
    get_loss,
    register_loss,
)

__all__ = [
    "LOSSES",
    "LossFactory",
    "LossOutput",
    "PreparedLoss",
    "cortex_grpo",
    "cortex_grpo_echo",
    "cross_entropy",
    "get_loss",
    "ppo",
    "register_loss",
    "verl_grpo",
]
