"""Structured access logs, one JSON line per request, tied together by a request id.

Every response carries ``X-Request-ID`` (the caller's, when it sent one, else a new one); the
``arctic_platform.access`` logger records ``{request_id, method, path, status, duration_ms}``.
Clients log the id of a failed request, so an operator can find the server's side of it.
A client that disconnects before its body arrived is status 499 (nginx's "client closed
request", :class:`~arctic_platform.server.errors.ClientDisconnected`): this line is all it logs.
An exception no route anticipated is answered here, inside the id's scope: a JSON 500 naming the
request id (:func:`~arctic_platform.server.errors.internal_error`), its traceback logged under it.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from starlette.responses import JSONResponse

from arctic_platform.server.errors import internal_error

REQUEST_ID_HEADER = "x-request-id"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
log = logging.getLogger("arctic_platform.access")
errors_log = logging.getLogger("arctic_platform.server")


class AccessLog:
    """ASGI middleware: assigns the request id, sets the header, logs the request when done."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        start = time.perf_counter()
        status = 500
        started = False

        async def send_with_id(message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started:  # part of the answer is out: only closing the connection can tell
                raise
            errors_log.exception("request %s: %s %s", request_id, scope["method"], scope["path"])
            error = internal_error(request_id)
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send_with_id)
        finally:
            log.info(
                json.dumps(
                    {
                        "request_id": request_id,
                        "method": scope["method"],
                        "path": scope["path"],
                        "status": status,
                        "duration_ms": round((time.perf_counter() - start) * 1000, 1),
                    }
                )
            )
