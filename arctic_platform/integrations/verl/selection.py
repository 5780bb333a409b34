"""Which remote backend a verl config chooses, and that backend attached from a handle.

verl's remote-backend trainers pick the backend by name: ``trainer.remote_backend`` (PR #6422) or
``remote_backend.name`` (PR #7102, filled by the ``remote_backend=<name>`` Hydra group). A config
that chooses none is a plain verl run: nothing here then touches the registry, so loading the
plugin in every verl process cannot change a default run.

The forwarder worker and the rollout replica re-create the backend through the registry (not by
naming our class), so a backend registered under another name with our worker keeps working.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from arctic_platform.integrations.verl.compat import remote_backend_api


def remote_backend_name(main_config: DictConfig) -> str | None:
    """The chosen backend's name, or None for a config that chooses none (verl's default)."""
    for key in ("trainer.remote_backend", "remote_backend.name"):
        name = OmegaConf.select(main_config, key, default=None)
        if name:
            return str(name)
    return None


def backend_for(main_config: DictConfig, *, handle: dict[str, Any] | None = None) -> Any:
    """The chosen backend, created (``handle=None``) or attached, or None when none is chosen."""
    name = remote_backend_name(main_config)
    if name is None:
        return None
    registry = remote_backend_api().RemoteBackendRegistry
    return registry.get(name).from_config(main_config, handle=handle)
