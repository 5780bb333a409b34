"""``arctic-platform serve``: the Service behind both HTTP APIs, on uvicorn.

Without a token the server only listens on loopback: the API can train and overwrite models, so
exposing it unauthenticated is refused rather than warned about.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.open_files import connection_limit, raise_open_files_limit
from arctic_platform.server.ray_placement import PLACEMENT_TIMEOUT_S
from arctic_platform.server.tenant_quota import DEFAULT_MAX_JOBS_PER_TENANT, TenantQuota
from arctic_platform.server.tinker.session_reaper import SESSION_TIMEOUT_S

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
log = logging.getLogger("arctic_platform.serve")


def default_share(slots: int, auth: TokenAuth) -> int:
    """Slots one tenant may hold: all of them with one tenant, else all but one."""
    return slots if auth.tenants <= 1 else max(1, slots - 1)


def serve(
    *,
    host: str,
    port: int,
    token_env: str | None,
    data_dir: Path,
    metrics_token_env: str | None = None,
    device: str,
    max_body_mb: int,
    max_concurrent_ops: int,
    log_level: str = "info",
    ray_address: str | None = None,
    colocate: bool = False,
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
    ray_autoscaling: bool = False,
    instance: str | None = None,
    parent_pid: int | None = None,
    sampling_engine: str = "torch",
    vllm_python: str | None = None,
    allowed_paths: tuple[Path, ...] = (),
    writable_paths: tuple[Path, ...] = (),
    max_ops_per_tenant: int | None = None,
    drain_timeout: float = 30.0,
    limits: ServerLimits | None = None,
    tinker_session_timeout_s: float = SESSION_TIMEOUT_S,
    job_idle_timeout_s: float | None = None,
    quota: TenantQuota | None = None,
) -> None:
    """Run the server until SIGINT/SIGTERM; ops in flight get ``drain_timeout`` seconds to
    finish, then their jobs are failed and the ops stopped.

    With ``ray_address`` (``auto``, ``local`` or a cluster address) the engines run as Ray
    actors on that cluster (``colocate``: trainer and samplers share devices); a job waits up to
    ``placement_timeout_s`` for resources other jobs hold, and, with ``ray_autoscaling``, for
    ones the cluster does not have yet. ``instance`` is
    the id ``/health`` reports (the launcher's, to recognise its server); with ``parent_pid`` the
    server stops when that process dies (:mod:`arctic_platform.server.parent_watch`).
    ``sampling_engine`` is the engine of sampling jobs that choose none; ``vllm_python`` the
    interpreter that runs vLLM for them. ``metrics_token_env`` names the variable holding the
    operator's scrape token for ``/metrics``. Tinker sessions without a heartbeat for
    ``tinker_session_timeout_s`` are finished; jobs with no op for ``job_idle_timeout_s`` (None:
    never) are cancelled. ``quota`` bounds each tenant's live jobs (by default
    :data:`~arctic_platform.server.tenant_quota.DEFAULT_MAX_JOBS_PER_TENANT`), model bytes and
    checkpoint bytes.
    """
    import uvicorn

    from arctic_platform.server.app import create_app
    from arctic_platform.server.http_protocol import http_protocol

    limits = limits or ServerLimits()
    from arctic_platform.server.service import Service, ServiceSettings

    try:
        auth = TokenAuth.from_env(token_env)
        metrics_auth = TokenAuth.from_env(metrics_token_env, flag="--metrics-token-env")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not auth.enabled and host not in LOOPBACK:
        raise SystemExit(
            f"refusing to listen on {host} without authentication; "
            "pass --token-env NAME (a variable holding the token) or use --host 127.0.0.1"
        )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    open_files = raise_open_files_limit()  # every connection is a file (open_files.py)
    if not auth.enabled:
        log.warning("no --token-env: serving without authentication on %s only", host)
    started_ray = False
    if ray_address is not None:
        from arctic_platform.server.ray_cluster import connect

        try:
            started_ray = connect(ray_address, field="--ray-address")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    service = Service(
        ServiceSettings(
            data_dir=data_dir,
            device=device,
            max_concurrent_ops=max_concurrent_ops,
            engine_backend="local" if ray_address is None else "ray",
            colocate=colocate,
            placement_timeout_s=placement_timeout_s,
            ray_autoscaling=ray_autoscaling,
            sampling_engine=sampling_engine,
            vllm_python=vllm_python,
            allowed_paths=allowed_paths,
            writable_paths=writable_paths,
            limits=limits,
            max_ops_per_tenant=max_ops_per_tenant or default_share(max_concurrent_ops, auth),
            drain_timeout_s=drain_timeout,
            job_idle_timeout_s=job_idle_timeout_s,
            quota=quota or TenantQuota(max_jobs_per_tenant=DEFAULT_MAX_JOBS_PER_TENANT),
        )
    )
    app = create_app(
        service,
        auth=auth,
        max_body_bytes=max_body_mb * 1024 * 1024,
        instance=instance,
        metrics_auth=metrics_auth,
        tinker_session_timeout_s=tinker_session_timeout_s,
    )
    engines = "in this process" if ray_address is None else f"on Ray ({ray_address})"
    log.info(
        "arctic-platform serving on http://%s:%d (data dir %s, engines %s)",
        host,
        port,
        data_dir,
        engines,
    )
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal; this handler turns
    # that into exit status 0, since SIGTERM is the normal way to stop a server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if parent_pid is not None:
        from arctic_platform.server.parent_watch import watch_parent

        watch_parent(parent_pid)

    class DrainingServer(uvicorn.Server):
        """Starts the Service's bounded drain when the shutdown signal arrives, so on-prem
        requests waiting on ops in flight end with it rather than hold uvicorn's shutdown."""

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                threading.Thread(target=service.close, name="drain", daemon=True).start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=http_protocol(limits.header_read_timeout),
        # A backstop: the drain ends every op by ``drain_timeout``; answers need a moment more.
        timeout_graceful_shutdown=drain_timeout + 10,
        limit_concurrency=connection_limit(open_files),  # beyond it: 503, files kept for work
    )
    try:
        DrainingServer(config).run()
    finally:
        if started_ray:
            import ray

            ray.shutdown()
