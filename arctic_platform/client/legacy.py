"""Fold the flat config fields RL frameworks already pass into the nested ``ArcticRLClientConfig``.

SkyRL and verl build the client config with the field names of the earlier ``arctic_platform.rl``
client (``model_name``, ``backend="local"``, ``comm_protocol``, ``training_gpus``, ``ds_config``,
``vllm_config``, ...), and the earlier unified client nested some of them (``backend: {type:
onprem|remote, protocol}``, ``training: {ds_config, ...}``, ``sampling:
{arctic_inference_config, ...}``). Those configs keep working: this module rewrites them into the
nested form before validation. The job fields fold as the contract says
(:mod:`arctic_platform.contract.legacy_config`, shared with the on-prem server's reference
``/initialize``); this module adds the backend:

* ``backend="local"`` (or no ``backend`` but a ``comm_protocol``) means the driver owns the engines:
  ``comm_protocol="ray"`` -> the ``ray`` backend, ``"http"`` -> the ``http`` backend with
  ``launch_local_server``. ``"dss-platform"`` means attach to an existing server (no launch).
  ``backend="local"`` is remembered (``legacy_backend``) so the ``ARCTIC_RL_BACKEND`` environment
  override can still switch such a config to Cortex.
* Top-level transport settings (``host``, ``port``, timeouts, ``colocate``, ...) go into the
  backend when it has such a field, else into ``ignored_settings``.
* A secret (``pat``) is refused: the config names the environment variable instead.
* Every flat field a caller set is kept as given (``legacy_fields``) and reads back as an attribute
  of the config (``config.comm_protocol``), because callers read their own fields after building
  the client (SkyRL decides whether to ship ``get_server_state()`` from ``comm_protocol``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from arctic_platform.client.config import (
    BACKEND_TYPES,
    CortexBackend,
    HttpBackend,
    InProcessBackend,
    RayBackend,
    did_you_mean,
)
from arctic_platform.contract.legacy_config import (
    LEGACY_FIELDS,
    TRANSPORT_FIELDS,
    JobFolder,
    split_legacy,
)

BACKEND_CLASSES = {
    "inprocess": InProcessBackend,
    "http": HttpBackend,
    "cortex": CortexBackend,
    "ray": RayBackend,
}


def fold_legacy(data: Mapping) -> dict[str, Any]:
    """``data`` with every legacy field folded into the nested form (see module doc)."""
    given = {k: v for k, v in data.items() if k in LEGACY_FIELDS}
    if isinstance(data.get("backend"), str):
        given["backend"] = data["backend"]
    out, flat = split_legacy(data)
    if given:
        out["legacy_fields"] = {**dict(out.get("legacy_fields") or {}), **given}
    backend = out.get("backend")
    old_backend_form = isinstance(backend, str) or (
        isinstance(backend, Mapping) and backend.get("type") in ("onprem", "remote")
    )
    if not flat and not old_backend_form:
        return out
    folder = _Folder(out, flat)
    folder.backend()
    folder.jobs()
    folder.job_settings()
    folder.record_leftovers()
    return folder.out


class _Folder(JobFolder):
    """The contract's job folding plus the client's backend fields."""

    def backend(self) -> None:
        backend = self.out.get("backend")
        protocol = self.flat.pop("comm_protocol", None)
        if isinstance(backend, Mapping) and backend.get("type") == "onprem":
            backend = self._onprem(backend)
        elif isinstance(backend, Mapping) and backend.get("type") == "remote":
            backend = self._remote(backend)
        elif isinstance(backend, Mapping):
            backend = dict(backend)  # transport fields are folded in below; never edit the input
        elif isinstance(backend, str):
            backend = self._named(backend, protocol)
        elif backend is None and protocol is not None:
            backend = self._named("local", protocol)
        if backend is not None:
            self.out["backend"] = backend
        self._fold_transport_fields(backend)

    def _named(self, name: str, protocol: Any) -> dict:
        if name in BACKEND_TYPES:
            return {"type": name}
        if name == "remote":
            return {"type": "cortex"}
        if name not in ("local", "dss-platform", "onprem"):
            known = {*BACKEND_TYPES, "local", "dss-platform", "onprem", "remote"}
            raise ValueError(
                f"backend: unknown backend {name!r}{did_you_mean(name, known)}; choose one of "
                f"{', '.join(BACKEND_TYPES)} (legacy names: local, dss-platform)"
            )
        protocol = "http" if protocol is None else protocol
        if protocol not in ("http", "ray", "cortex"):
            raise ValueError(f"comm_protocol: expected http, ray or cortex, got {protocol!r}")
        if name == "local":
            self.out["legacy_backend"] = "local"
        elif name == "dss-platform":
            self.out["legacy_backend"] = "dss-platform"
        if protocol == "http":
            launch = self.flat.pop("launch_local_server", name == "local")
            return {"type": "http", "launch_local_server": launch}
        return {"type": protocol}

    def _onprem(self, backend: Mapping) -> dict:
        rest = {k: v for k, v in backend.items() if k not in ("type", "protocol")}
        protocol = backend.get("protocol", "http")
        if protocol not in ("http", "ray"):
            raise ValueError(f"backend.protocol: expected http or ray, got {protocol!r}")
        for key in ("colocate", "server_cuda_visible_devices"):
            if key in rest and key not in BACKEND_CLASSES[protocol].model_fields:
                self.ignored[f"backend.{key}"] = rest.pop(key)
        return {"type": protocol, **rest}

    def _remote(self, backend: Mapping) -> dict:
        if backend.get("protocol", "cortex") != "cortex":
            raise ValueError(f"backend.protocol: expected cortex, got {backend['protocol']!r}")
        if "pat" in backend:
            raise ValueError(
                "backend.pat: secrets do not belong in the config; put the token in an "
                "environment variable and name it in backend.pat_env_var"
            )
        return {
            "type": "cortex",
            **{k: v for k, v in backend.items() if k not in ("type", "protocol")},
        }

    def _fold_transport_fields(self, backend: Any) -> None:
        """Top-level host/port/timeouts/... go into the backend when it has such a field."""
        fields: set[str] = set()
        if isinstance(backend, dict) and backend.get("type") in BACKEND_CLASSES:
            fields = set(BACKEND_CLASSES[backend["type"]].model_fields)
        for key in sorted(TRANSPORT_FIELDS - {"comm_protocol"}):
            if key not in self.flat:
                continue
            value = self.flat.pop(key)
            if key in fields:
                backend.setdefault(key, value)  # an explicit nested value wins
            else:
                self.ignored[key] = value
