"""The one poll loop of the test suite: wait, with a deadline, until something holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    *,
    what: str = "the condition",
    timeout_s: float = 120.0,
    interval_s: float = 0.02,
) -> T:
    """Call ``condition`` every ``interval_s`` until it returns something truthy, and return
    that; an ``AssertionError`` naming ``what`` (and the last value) past ``timeout_s``.

    A condition may assert too: a value that can never become true should fail at once rather
    than at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s (last: {value!r})"
        time.sleep(interval_s)
    return value
