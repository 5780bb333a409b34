"""Attach to a Ray cluster, or start one, from an ``address`` setting: ``auto``, ``local`` or an
address.

* ``auto``: the cluster this process already belongs to (inside a Ray task or actor, or after the
  application's own ``ray.init``), else the one ``RAY_ADDRESS`` names, else a new single-machine
  cluster private to this process. A cluster that merely happens to run on the same machine (a
  ``ray start --head`` someone left behind) is *not* joined: attaching is something the config or
  ``RAY_ADDRESS`` says.
* ``local``: always a new single-machine cluster, private to this process.
* ``<host>:<port>`` (the GCS address ``ray start --head`` prints) or ``ray://<host>:<port>`` (Ray
  Client): that cluster.

Which cluster was joined (or started) is logged at INFO. ``ray.init`` retries an address nobody
answers on for minutes, so a named address (or ``RAY_ADDRESS``) is first probed, and a dead one
fails at once with an error naming the setting. The dashboard is never started (it needs extra
packages and a port).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0
log = logging.getLogger(__name__)


def connect(
    address: str,
    *,
    namespace: str | None = None,
    num_cpus: int | None = None,
    field: str = "backend.address",
) -> bool:
    """Make this process a Ray driver per ``address`` (see module doc).

    Returns True when this call initialised Ray, so the caller owns the ``ray.shutdown()``; False
    when Ray was already initialised here (inside a Ray task or actor, or by the application),
    in which case ``namespace`` and ``num_cpus`` do not apply.
    """
    import ray

    if ray.is_initialized():
        log.info("Ray: using the cluster this process already belongs to (%s)", _gcs_address())
        return False
    options = {"include_dashboard": False, "namespace": namespace}
    named = os.environ.get("RAY_ADDRESS", "").strip() if address == "auto" else address
    if not named or named == "local":
        # address="local": ray.init() without an address would join any cluster on this machine.
        ray.init(address="local", num_cpus=num_cpus, **options)
        log.info("Ray: started a private single-machine cluster at %s", _gcs_address())
        return True
    source = "RAY_ADDRESS" if address == "auto" else field
    _probe(named, source, hint="start one with `ray start --head`, or use auto or local")
    ray.init(address=named, **options)
    log.info("Ray: joined the cluster at %s (from %s)", named, source)
    return True


def _gcs_address() -> str:
    import ray

    with contextlib.suppress(Exception):  # Ray Client sessions have no GCS address to show
        return ray.get_runtime_context().gcs_address
    return "unknown address"


def _probe(address: str, field: str, *, hint: str) -> None:
    """Fail fast, naming ``field``, unless a Ray cluster answers at ``address``.

    A GCS address gets one cluster-id RPC (any answer from a GCS, even "unauthenticated",
    counts): a bare TCP connect is not enough where a proxy accepts every connection. A Ray
    Client address (``ray://``) gets a TCP connect, and Ray Client's own retries after that.
    """
    client = address.startswith("ray://")
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if not host or port is None or parsed.scheme not in ("ray", "gcs"):
        raise ValueError(
            f"{field}: {address!r} is not a Ray address; expected auto, local, host:port or "
            "ray://host:port"
        )
    try:
        with contextlib.closing(socket.create_connection((host, port), PROBE_TIMEOUT_S)):
            pass
        if not client:
            _ask_gcs(host, port)
    except (OSError, _NotAGcs) as exc:
        problem = f"no Ray cluster answers at {address!r} ({exc})"
        raise ValueError(f"{field}: {problem}; {hint}") from None


class _NotAGcs(Exception):
    """Something answered, but not a Ray GCS."""


def _ask_gcs(host: str, port: int) -> None:
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # a Ray without these modules: the TCP connect is all we can check
        return

    alive = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() not in alive:
                raise _NotAGcs(f"{exc.code().name}: {exc.details()}") from None
