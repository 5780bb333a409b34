"""The surface RL frameworks already import: ``from arctic_platform.rl import
ArcticRLClientConfig, create_arctic_rl_client``.

Lazy (PEP 562): importing this package loads nothing; each name is imported on first use, and
none of them needs torch, Ray or FastAPI. The names are those of :mod:`arctic_platform.client`,
so both import paths give the same objects.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ArcticRLClientConfig": "arctic_platform.client.config",
    "create_arctic_rl_client": "arctic_platform.client.factory",
    "ArcticRLClient": "arctic_platform.client.client",
    "SyncArcticRLClient": "arctic_platform.client.client",
    "ArcticRLError": "arctic_platform.client.errors",
    "ServerError": "arctic_platform.client.errors",
}

__all__ = [*sorted(_LAZY), "processors"]


def __getattr__(name: str) -> Any:
    if name == "processors":
        return importlib.import_module("arctic_platform.rl.processors")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'arctic_platform.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
