"""``create_arctic_rl_client``: config in, ready client out, backend chosen by the config.

The YAML's ``backend:`` is the way to choose a backend. For launchers whose framework hard-codes
``backend="local"`` (SkyRL, the earlier verl adapter) and cannot be edited, an environment
override exists as a fallback: ``ARCTIC_RL_BACKEND=cortex`` with ``CORTEX_BASE_URL`` or
``CORTEX_HOST``, ``CORTEX_DATABASE``, ``CORTEX_SCHEMA``, and optionally ``CORTEX_ENDPOINT`` and
``CORTEX_PAT_ENV_VAR``; or ``ARCTIC_RL_BACKEND=http`` with ``ARCTIC_RL_HTTP_URL`` (and optionally
``ARCTIC_RL_HTTP_TOKEN_ENV``); or ``ARCTIC_RL_BACKEND=inprocess``. It rewrites the backend only
when the config says the legacy ``local`` backend or leaves the default; a config that names its
backend explicitly wins, and the override is logged at INFO either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Literal, overload

from pydantic import ValidationError

from arctic_platform.client.client import ArcticRLClient, SyncArcticRLClient
from arctic_platform.client.config import (
    ArcticRLClientConfig,
    CortexBackend,
    HttpBackend,
    InProcessBackend,
    load_config,
)

log = logging.getLogger(__name__)

BACKEND_ENV = "ARCTIC_RL_BACKEND"
CORTEX_ENV = {
    "base_url": "CORTEX_BASE_URL",
    "host": "CORTEX_HOST",
    "database": "CORTEX_DATABASE",
    "schema": "CORTEX_SCHEMA",
    "endpoint": "CORTEX_ENDPOINT",
    "pat_env_var": "CORTEX_PAT_ENV_VAR",
}
HTTP_ENV = {"url": "ARCTIC_RL_HTTP_URL", "token_env": "ARCTIC_RL_HTTP_TOKEN_ENV"}


@overload
def create_arctic_rl_client(
    config: ArcticRLClientConfig | Mapping | str | os.PathLike,
    server_state: Any = None,
    *,
    blocking_calls: Literal[False] = False,
    arctic_rl_server_state: Any = None,
    http_transport: Any = None,
) -> ArcticRLClient: ...


@overload
def create_arctic_rl_client(
    config: ArcticRLClientConfig | Mapping | str | os.PathLike,
    server_state: Any = None,
    *,
    blocking_calls: Literal[True],
    arctic_rl_server_state: Any = None,
    http_transport: Any = None,
) -> SyncArcticRLClient: ...


def create_arctic_rl_client(
    config: ArcticRLClientConfig | Mapping | str | os.PathLike,
    server_state: Any = None,
    *,
    blocking_calls: bool = False,
    arctic_rl_server_state: Any = None,
    http_transport: Any = None,
) -> ArcticRLClient | SyncArcticRLClient:
    """Create the configured jobs (or attach to ``*_job_id``) and return a client for them.

    ``config`` is a config object, a dict, or the path of a YAML file. ``server_state`` is what
    another client's ``get_server_state()`` returned, for reconnecting (``arctic_rl_server_state``
    is its older name). ``blocking_calls=True`` returns a :class:`SyncArcticRLClient`.
    ``http_transport`` is an ``httpx.BaseTransport`` for the ``http`` and ``cortex`` backends to
    send through (fault injection in tests, proxies).
    """
    if arctic_rl_server_state is not None:
        if server_state is not None and server_state is not arctic_rl_server_state:
            raise TypeError("give server_state or arctic_rl_server_state, not both")
        server_state = arctic_rl_server_state
    resolved = apply_env_override(load_config(config))
    cls = SyncArcticRLClient if blocking_calls else ArcticRLClient
    return cls(resolved, server_state, http_transport=http_transport)


def apply_env_override(config: ArcticRLClientConfig) -> ArcticRLClientConfig:
    """``config`` with its backend replaced per ``ARCTIC_RL_BACKEND`` (module doc), if allowed."""
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not choice:
        return config
    if choice not in ("cortex", "http", "inprocess"):
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected cortex, http or inprocess")
    overridable = config.legacy_backend == "local" or (
        "backend" not in config.model_fields_set and isinstance(config.backend, InProcessBackend)
    )
    if not overridable:
        log.info(
            "%s=%s ignored: the config chooses the %s backend explicitly",
            BACKEND_ENV,
            choice,
            config.backend.type,
        )
        return config
    if choice == "cortex":
        backend: Any = _from_env(CortexBackend, CORTEX_ENV, choice)
        where = backend.prefix
    elif choice == "http":
        if not os.environ.get(HTTP_ENV["url"]):
            raise ValueError(f"{BACKEND_ENV}=http: set {HTTP_ENV['url']} (the server's URL)")
        backend = _from_env(HttpBackend, HTTP_ENV, choice)
        where = backend.base_url
    else:
        backend = InProcessBackend()
        where = "this process"
    log.info(
        "%s=%s: using the %s backend at %s instead of the config's %s backend "
        "(environment override; prefer `backend:` in the YAML)",
        BACKEND_ENV,
        choice,
        backend.type,
        where,
        config.backend.type,
    )
    return config.model_copy(update={"backend": backend, "legacy_backend": None})


def _from_env(cls, names: dict[str, str], choice: str):
    values = {field: os.environ[env] for field, env in names.items() if os.environ.get(env)}
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(e["msg"] for e in exc.errors())
        variables = ", ".join(names.values())
        raise ValueError(f"{BACKEND_ENV}={choice}: {problems} (set via {variables})") from None
