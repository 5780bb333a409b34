"""The transports, one per backend, and :func:`make_transport`, which picks one from the config.

Each transport module imports its heavy dependencies only when chosen, so a client-only install
(no torch, no FastAPI, no Ray) can use ``http`` and ``cortex``, and choosing ``inprocess`` or
``ray`` without their extras raises an ImportError naming the extra to install.
"""

from __future__ import annotations

from typing import Any

from arctic_platform.client.config import (
    ArcticRLClientConfig,
    CortexBackend,
    HttpBackend,
    InProcessBackend,
    RayBackend,
)
from arctic_platform.client.transport import Transport


def make_transport(
    config: ArcticRLClientConfig, server_state: Any = None, *, http_transport: Any = None
) -> Transport:
    """The transport for ``config.backend`` (``server_state``: see each transport;
    ``http_transport``: the ``httpx.BaseTransport`` the ``http`` and ``cortex`` backends send
    through, for fault injection)."""
    backend = config.backend
    if http_transport is not None and not isinstance(backend, (HttpBackend, CortexBackend)):
        raise ValueError(
            f"http_transport: the {backend.type} backend sends no HTTP; it applies to http and "
            "cortex"
        )
    if isinstance(backend, InProcessBackend):
        from arctic_platform.client.transports.inprocess import InProcessTransport

        return InProcessTransport(config, server_state)
    if isinstance(backend, RayBackend):
        from arctic_platform.client.transports.ray import ray_transport

        return ray_transport(config, server_state)
    if server_state is not None:
        raise ValueError(
            f"server_state: the {backend.type} backend reattaches by job ids alone "
            "(reconnect_config()); pass server_state=None"
        )
    if isinstance(backend, HttpBackend):
        from arctic_platform.client.transports.http import HttpTransport

        return HttpTransport(config, http_transport=http_transport)
    if isinstance(backend, CortexBackend):
        from arctic_platform.client.transports.cortex import CortexTransport

        return CortexTransport(config, http_transport=http_transport)
    raise TypeError(f"backend: unsupported backend {type(backend).__name__}")
