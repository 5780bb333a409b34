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


class FieldError(ValueError):
    """Bad input, naming the field at fault (``sampling_params[3].top_p``, ``batch.advantages``).

    The one exception for it: the contract's rules raise it, the engines raise it through their
    :class:`~arctic_platform.engine.errors.EngineInputError`, and every surface answers it as a
    400 naming ``field``, so no layer translates one field error into another.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
