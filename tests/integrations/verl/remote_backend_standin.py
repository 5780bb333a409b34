"""STAND-IN for ``verl.remote_backend``, which no verl release has yet (verl 0.9.1 lacks it).

Written for these tests from the contract in ``reference/verl_contract.md`` §1 (verl-project/verl
PRs #6422 and #7102), not copied from them: the ``RemoteBackend`` ABC (lifecycle only) and the
process-wide ``RemoteBackendRegistry``:

* ``register(name)`` is a decorator factory; the same class again is a no-op, another class under
  a taken name raises ``ValueError``;
* ``get(name)`` raises ``KeyError`` for an unknown name; ``create(name, cfg)`` is
  ``get(name).from_config(cfg)``; ``list()`` is sorted;
* ``register_worker(name, loader)`` stores a zero-argument loader (the same loader again is a
  no-op, another raises ``ValueError``); ``get_worker(name)`` calls it once, caches the class, and
  returns None for a name without a loader.

Tests install it into ``sys.modules`` as ``verl.remote_backend`` (and ``.base``); nothing else of
verl is faked. The module imports nothing from verl, so a subprocess can install it before
``import verl`` runs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar


class RemoteBackend(abc.ABC):
    """Lifecycle contract of a remote backend (compute methods live on the concrete class)."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None):
        """Create (``handle=None``) or re-attach (``handle``) an instance."""

    @abc.abstractmethod
    def reconnect_handle(self) -> dict[str, Any]:
        """A serialisable dict that ``from_config(..., handle=)`` accepts."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Tear down, synchronously; idempotent."""

    @abc.abstractmethod
    async def update_weights(self) -> dict[str, Any]:
        """Sync train weights to the rollout engine."""

    @abc.abstractmethod
    async def save_checkpoint(self) -> dict[str, Any]:
        """Persist model and optimizer state."""

    @abc.abstractmethod
    def requires_single_forwarder(self) -> bool:
        """True if the trainer must run exactly one forwarder worker."""


class RemoteBackendRegistry:
    """Process-wide registry of backend classes and lazy forwarder-worker loaders."""

    _backends: ClassVar[dict[str, type]] = {}
    _worker_loaders: ClassVar[dict[str, Callable[[], type]]] = {}
    _resolved_workers: ClassVar[dict[str, type]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[type], type]:
        def decorate(backend_cls: type) -> type:
            existing = cls._backends.get(name)
            if existing is not None and existing is not backend_cls:
                raise ValueError(f"remote backend {name!r} is already registered ({existing})")
            cls._backends[name] = backend_cls
            return backend_cls

        return decorate

    @classmethod
    def get(cls, name: str) -> type:
        if name not in cls._backends:
            raise KeyError(
                f"Unknown remote backend {name!r}. Registered: {cls.list()}. Load a plugin with "
                "VERL_USE_EXTERNAL_MODULES=..."
            )
        return cls._backends[name]

    @classmethod
    def create(cls, name: str, main_config: Any) -> RemoteBackend:
        return cls.get(name).from_config(main_config)

    @classmethod
    def list(cls) -> list[str]:
        return sorted(cls._backends)

    @classmethod
    def register_worker(cls, name: str, loader: Callable[[], type]) -> None:
        existing = cls._worker_loaders.get(name)
        if existing is not None and existing is not loader:
            raise ValueError(f"a worker loader for {name!r} is already registered")
        cls._worker_loaders[name] = loader

    @classmethod
    def get_worker(cls, name: str) -> type | None:
        if name in cls._resolved_workers:
            return cls._resolved_workers[name]
        loader = cls._worker_loaders.get(name)
        if loader is None:
            return None
        worker = loader()
        cls._resolved_workers[name] = worker
        return worker
