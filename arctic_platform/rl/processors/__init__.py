"""Server-side loss processors under their old import path (``arctic_platform.rl.processors``).

``verl_grpo`` is the loss the verl and SkyRL integrations name in ``processing.loss_fn``; its
module needs torch, so it is imported only when asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["verl_grpo"]


def __getattr__(name: str) -> Any:
    if name == "verl_grpo":
        return importlib.import_module("arctic_platform.rl.processors.verl_grpo")
    raise AttributeError(f"module 'arctic_platform.rl.processors' has no attribute {name!r}")
