"""The ``verl_grpo`` loss under its earlier import path (a compatibility re-export).

It lives in :mod:`arctic_platform.integrations.verl.grpo_loss` (verl-shaped entry points) on top of
the engine's loss registry; every name here is the same object as there, and the names are that
module's ``__all__``. Send ``processing={"loss_fn": LOSS_NAME}`` to have the server apply it.
"""

from __future__ import annotations

from arctic_platform.integrations.verl.grpo_loss import *  # noqa: F403
from arctic_platform.integrations.verl.grpo_loss import __all__  # noqa: F401
