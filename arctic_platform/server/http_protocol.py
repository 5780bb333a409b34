"""The HTTP protocol the server speaks: uvicorn's httptools one, with a deadline on request heads.

uvicorn bounds a connection only between requests (its keep-alive timeout starts once a response
is sent). A connection that never sends a byte, or that sends a request head one header line at a
time, is held for as long as the client likes: a few hundred such connections, which cost the
client nothing and need no credentials, tie up the server's sockets and its event loop's
bookkeeping (slowloris). So a request's head (request line and headers) must be complete within
``--header-read-timeout`` seconds of the connection opening or of the request's first byte;
otherwise the connection is closed. Bodies have their own deadline (``--body-read-timeout``,
:mod:`arctic_platform.server.http_common`), and a request whose head arrived is never cut here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class HeadDeadlineProtocol(HttpToolsProtocol):
    """httptools with the request-head deadline of the module doc."""

    def __init__(self, *args: Any, header_read_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_read_timeout = header_read_timeout
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._cancel_head_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # Between requests uvicorn's keep-alive timeout applies; the next head re-arms ours.
        self._cancel_head_deadline()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_read_timeout, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            client = "{}:{}".format(*self.client) if self.client else "a client"
            log.info(
                "closed the connection of %s: no complete request head within %g s "
                "(--header-read-timeout)",
                client,
                self.header_read_timeout,
            )
            self.transport.close()


def http_protocol(header_read_timeout: float) -> functools.partial:
    """The protocol factory uvicorn's ``Config(http=...)`` takes."""
    return functools.partial(HeadDeadlineProtocol, header_read_timeout=header_read_timeout)
