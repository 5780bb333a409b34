"""The ``ray`` backend: the interface and reconnect rules; the Ray server side comes later.

What this backend will be (the Ray backend issue builds the server side): the engines run as Ray
actors, one per device, with the trainer data-parallel; a named job-registry actor owns the jobs.
The client contract is already fixed here, and is the same as on every other backend:

* ``create_arctic_rl_client(config)`` with ``backend: {type: ray, address: auto|local|<addr>}``
  creates the configured jobs and returns the usual client.
* ``client.get_server_state()`` returns the registry actor's handle; ``client.reconnect_config()``
  the config with the job ids. A Ray task rebuilds the client with
  ``create_arctic_rl_client(reconnect_config, server_state)`` and attaches to the same jobs
  without creating or destroying any (as SkyRL and verl do across processes).

Until the server side exists, choosing this backend fails clearly: an ImportError naming the
``ray`` extra when Ray is missing, otherwise :class:`BackendUnavailableError`. Nothing pretends to
run.
"""

from __future__ import annotations

from typing import Any

from arctic_platform._extras import require
from arctic_platform.client.config import ArcticRLClientConfig
from arctic_platform.client.errors import BackendUnavailableError
from arctic_platform.client.transport import Transport

RAY_ISSUE = "issue 9 (the Ray backend)"


def ray_transport(config: ArcticRLClientConfig, server_state: Any = None) -> Transport:
    """The Ray transport (see module doc): checks the request, then says it is not here yet."""
    require("ray", "ray", purpose="the ray backend")
    if server_state is not None and not config.reconnecting:
        raise ValueError(
            "server_state: reconnecting also needs the job ids; build the client from "
            "client.reconnect_config() together with client.get_server_state()"
        )
    raise BackendUnavailableError(
        "the ray backend's server side (Ray actors running the engines) is not implemented yet; "
        f"it arrives with {RAY_ISSUE}. Use backend type inprocess, http or cortex meanwhile."
    )
