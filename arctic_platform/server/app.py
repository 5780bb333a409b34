"""The FastAPI application: both HTTP APIs over one Service.

``create_app`` is what ``arctic-platform serve`` runs and what tests mount through httpx's ASGI
transport, so tests exercise the exact app users get.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from arctic_platform.server import cortex, jobs_api, onprem
from arctic_platform.server.access_log import AccessLog
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.errors import BadRequest, ServiceError
from arctic_platform.server.http_common import (
    TenantSlots,
    close_unread_bodies,
    owner_of,
    service_error_response,
)
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.openai import routes as openai_routes
from arctic_platform.server.service import Service
from arctic_platform.server.tinker import routes as tinker_routes
from arctic_platform.server.tinker.operations import TinkerOps
from arctic_platform.server.tinker.session_reaper import SESSION_TIMEOUT_S
from arctic_platform.server_identity import new_instance_id

DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024


def create_app(
    service: Service,
    *,
    auth: TokenAuth | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    close_service_on_shutdown: bool = True,
    instance: str | None = None,
    metrics_auth: TokenAuth | None = None,
    tinker_session_timeout_s: float = SESSION_TIMEOUT_S,
) -> FastAPI:
    """An app serving ``service`` with the on-prem (ops and ``/jobs``), Cortex-compatible,
    Tinker and OpenAI-compatible routers. ``instance`` is the id ``/health`` reports (a fresh
    one by default); ``metrics_auth`` holds the operator's scrape token, the one that sees every
    job in ``/metrics``; Tinker sessions without a heartbeat for ``tinker_session_timeout_s`` are
    finished.
    """
    tinker = TinkerOps(service, session_timeout_s=tinker_session_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tinker.start()
        yield
        tinker.close()
        if close_service_on_shutdown:
            service.close()

    app = FastAPI(title="arctic-platform", lifespan=lifespan)
    app.state.service = service
    app.state.auth = auth or TokenAuth([])
    app.state.metrics_auth = metrics_auth or TokenAuth([])
    app.state.max_body_bytes = max_body_bytes
    app.state.uploads = TenantSlots(ServerLimits.check_uploads)
    app.state.long_polls = TenantSlots(ServerLimits.check_long_polls)
    app.state.openai_requests = TenantSlots(ServerLimits.check_openai_requests)
    app.state.instance = instance or new_instance_id()
    app.state.tinker = tinker
    app.add_exception_handler(ServiceError, service_error_response)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_api_route("/metrics", _metrics, methods=["GET"], include_in_schema=False)
    app.include_router(cortex.router)
    app.include_router(jobs_api.router)
    app.include_router(onprem.router)
    app.include_router(tinker_routes.router)
    for prefix in openai_routes.PREFIXES:
        app.include_router(openai_routes.router, prefix=prefix)
    app.add_middleware(close_unread_bodies)
    app.add_middleware(AccessLog)
    return app


async def _metrics(request: Request) -> Response:
    """Prometheus metrics of the Service (see server/metrics.py): every job's series for the
    operator's scrape token, the caller's own jobs for a tenant's token."""
    service = request.app.state.service
    if request.app.state.metrics_auth.holds(request.headers.get("authorization")):
        body = service.metrics_exposition(owner=None, every_tenant=True)
    else:
        body = service.metrics_exposition(owner=owner_of(request))
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A bad route parameter (``?job_id=`` missing, ``?wait_s=-1``) is a 400 naming it, in the
    same body as every other bad input (``field``: its name, without FastAPI's ``query.``)."""
    errors = exc.errors()
    named = [(".".join(str(p) for p in e["loc"][1:]) or "body", e["msg"]) for e in errors]
    problems = "; ".join(f"{name}: {msg}" for name, msg in named)
    return service_error_response(request, BadRequest(problems, field=named[0][0]))
