"""Attach to a Ray cluster, or start one, from an ``address`` setting: ``auto``, ``local`` or an
address.

* ``auto``: the cluster this process already belongs to, else the one ``RAY_ADDRESS`` or a local
  ``ray start --head`` points at, else a new single-machine cluster.
* ``local``: always a new single-machine cluster, private to this process.
* ``<host>:<port>`` (the GCS address ``ray start --head`` prints) or ``ray://<host>:<port>`` (Ray
  Client): that cluster.

``ray.init`` retries an address nobody answers on for minutes, so a named address (or the one
``auto`` found) is first probed with a plain TCP connect, and a dead one fails at once with an
error naming the setting. The dashboard is never started (it needs extra packages and a port).
"""

from __future__ import annotations

import contextlib
import socket
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0


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
        return False
    options = {"include_dashboard": False, "namespace": namespace}
    if address == "local":
        ray.init(num_cpus=num_cpus, **options)
        return True
    if address == "auto":
        found = _discovered_address(field)
        if found is None:
            ray.init(num_cpus=num_cpus, **options)
            return True
        _probe(found, field, hint="the cluster RAY_ADDRESS or `ray start` left behind")
        ray.init(address=found, **options)
        return True
    _probe(address, field, hint="start one with `ray start --head`, or use auto or local")
    ray.init(address=address, **options)
    return True


def free_port() -> int:
    """A TCP port nobody listens on right now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _discovered_address(field: str) -> str | None:
    """The address ``auto`` resolves to (RAY_ADDRESS, then the latest local cluster), or None."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address("auto")
    except (ValueError, ConnectionError) as exc:
        raise ValueError(f"{field}: auto could not resolve a Ray cluster address: {exc}") from None


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
