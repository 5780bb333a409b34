"""What is wrong with a value, as the contract's rules say it (see :mod:`contract.bodies`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """What is wrong with a value: ``field`` (its path), ``message``, and ``wrong_type`` (the
    value has the wrong type, a ``TypeError`` for Python callers, rather than a bad value)."""

    field: str
    message: str
    wrong_type: bool = False

    def __str__(self) -> str:
        return f"{self.field} {self.message}"
