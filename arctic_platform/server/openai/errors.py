"""The one mapping of our errors to OpenAI's shape, ``{"error": {message, type, param, code}}``
with the same status, for every route of this API (:class:`OpenAIRoute`)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from arctic_platform.server.errors import BadRequest, ServiceError

# OpenAI's error ``type`` by status (the SDK picks its exception class by status).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(exc: ServiceError) -> dict:
    """``exc`` in OpenAI's shape; ``param`` is the request field (or limit) it names."""
    param = exc.details.get("param") or exc.details.get("field") or exc.details.get("limit")
    return {
        "error": {
            "message": exc.message,
            "type": _TYPES.get(exc.status, "server_error"),
            "param": param,
            "code": exc.code,
        }
    }


def error_response(exc: ServiceError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=error_body(exc))


class OpenAIRoute(APIRoute):
    """A route whose errors leave in OpenAI's shape (the app's handlers use the Cortex shape)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except ServiceError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
                param = ".".join(str(p) for p in first["loc"] if p != "body") or None
                return error_response(BadRequest(f"{param}: {first['msg']}", param=param))

        return handle
