"""Noticing a hung or stopped server while a long op is in flight.

An on-prem op is one HTTP request that stays open while the op runs, possibly for many minutes, so
its read timeout must be long; a server that stops answering (SIGSTOP, a wedged host, a network
partition that keeps the socket open) would then go unnoticed for that long. While such a request
is in flight, :class:`LivenessWatch` asks the server's ``/health`` every few seconds on a separate
connection; when no answer came for ``liveness_timeout`` seconds, the op fails at once with an
error that names the cause. The request's own thread is abandoned (it ends when the socket does).

A Cortex op is a submission and polls, each a short request, but a hung server leaves any of them
waiting for the whole request timeout (and its retries); the cortex transport runs the op under
the same watch, probing the API's ``capacity`` route (the Cortex API has no ``/health``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import httpx

from arctic_platform.client.errors import TransportError

T = TypeVar("T")
PROBE_INTERVAL_S = 5.0


class ServerUnresponsiveError(TransportError):
    """The server stopped answering while an op was in flight; the op's outcome is unknown."""


class LivenessWatch:
    """Runs blocking calls while checking that the server at ``base_url`` answers ``/health``."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        liveness_timeout: float,
        *,
        probe: str = "/health",
        verify: bool = True,
    ) -> None:
        """Probe ``GET {base_url}{probe}``; any answer below 500 means the server is alive."""
        self.base_url = base_url
        self.liveness_timeout = liveness_timeout
        self.interval = min(PROBE_INTERVAL_S, liveness_timeout / 3)
        self.probe = probe
        self._probe = httpx.Client(
            base_url=base_url, headers=headers, timeout=self.interval, verify=verify
        )

    def close(self) -> None:
        self._probe.close()

    def run(self, call: Callable[[], T], *, op: str) -> T:
        """``call()``'s result, or :class:`ServerUnresponsiveError` once the server is silent for
        ``liveness_timeout`` seconds (``call`` keeps running on its own thread until then)."""
        future: Future = Future()

        def target() -> None:
            try:
                future.set_result(call())
            except BaseException as exc:  # delivered to the waiting caller
                future.set_exception(exc)

        threading.Thread(target=target, name=f"arctic-{op}", daemon=True).start()
        last_answer = time.monotonic()
        while True:
            try:
                return future.result(timeout=self.interval)
            except FutureTimeout:
                pass
            if self._alive():
                last_answer = time.monotonic()
            elif time.monotonic() - last_answer >= self.liveness_timeout:
                raise ServerUnresponsiveError(
                    f"{op}: the server at {self.base_url} has not answered {self.probe} for "
                    f"{self.liveness_timeout:g}s while the op was in flight: it is hung, stopped "
                    "(e.g. SIGSTOP) or unreachable; the op's outcome is unknown"
                )

    def _alive(self) -> bool:
        try:
            return self._probe.get(self.probe).status_code < 500
        except httpx.HTTPError:
            return False
