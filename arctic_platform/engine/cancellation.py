"""Stopping an op in flight: a token the engines check between decode steps and microbatches.

A cancelled job (or a server draining on shutdown) must not wait for a long generation to end.
The Service runs each op inside :func:`scope` with the op's :class:`CancelToken`; engine loops call
:func:`check` at points where stopping leaves the engine consistent (between decode steps of a
generation, between microbatches of a forward pass), which raises :class:`OpCancelled` once the
token is set. Code that runs outside any scope (a training loop using an engine directly) never
stops early. The token travels in a context variable so that engine signatures need not change.

One microbatch can be long (a row as long as the model's context), so :func:`stop_before_blocks`
makes each transformer block of a model a stop point as well: a cancel ends even a single-row
forward (or its recomputation in a checkpointed backward) within one block's compute.

Processes that must stop together (the ranks of a data-parallel job, which meet in collectives)
run their loop under :func:`deferred`: the engine checks then raise nothing, and the loop asks
the returned function at points where all ranks agree (one all-reduce) whether to stop.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any


class OpCancelled(Exception):
    """The op was stopped before it finished; ``reason`` says why (job cancelled, shutdown)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CancelToken:
    """Set once, from any thread; checked by the thread running the op."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = "cancelled"

    def cancel(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


_current: contextvars.ContextVar[tuple[CancelToken, ...]] = contextvars.ContextVar(
    "arctic_cancel_tokens", default=()
)


@contextlib.contextmanager
def scope(*tokens: CancelToken) -> Iterator[None]:
    """Run the body so that :func:`check` raises once any of ``tokens`` is cancelled."""
    reset = _current.set(_current.get() + tokens)
    try:
        yield
    finally:
        _current.reset(reset)


def requested() -> str | None:
    """Why the op running on this thread was cancelled, or None while it may go on."""
    return _reason(_current.get())


def current_tokens() -> tuple[CancelToken, ...]:
    """The tokens of the op running on this thread, for work done on its behalf by another
    thread (the sampler's decode loop runs every waiting call's sequences on one thread)."""
    return _current.get()


def reason_of(tokens: tuple[CancelToken, ...]) -> str | None:
    """Why the op holding ``tokens`` (from :func:`current_tokens`) was cancelled, or None."""
    return _reason(tokens)


def check() -> None:
    """Raise :class:`OpCancelled` if the op running on this thread was cancelled."""
    reason = requested()
    if reason is not None:
        raise OpCancelled(reason)


@contextlib.contextmanager
def deferred() -> Iterator[Callable[[], str | None]]:
    """Run the body with :func:`check` never raising; yields what :func:`requested` would say
    outside, for a caller that decides together with other processes when to stop."""
    tokens = _current.get()
    reset = _current.set(())
    try:
        yield lambda: _reason(tokens)
    finally:
        _current.reset(reset)


def _reason(tokens: tuple[CancelToken, ...]) -> str | None:
    for token in tokens:
        if token.cancelled:
            return token.reason
    return None


def stop_before_blocks(model: Any) -> int:
    """Call :func:`check` before every transformer block of ``model`` (a forward pre-hook on each
    module whose class the model lists in ``_no_split_modules``, transformers' name for its
    blocks); returns how many blocks became stop points.

    Safe under data parallelism: where ranks must stop together they run under :func:`deferred`,
    in which :func:`check` never raises, so a block's check stops one rank only where a rank may
    stop alone (one process, or a DDP no-grad forward, which has no collective).
    """
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    count = 0
    for module in model.modules():
        if type(module).__name__ in blocks:
            module.register_forward_pre_hook(_check_hook)
            count += 1
    return count


def _check_hook(module: Any, args: Any) -> None:
    check()
