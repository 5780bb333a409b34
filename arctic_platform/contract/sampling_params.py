"""Sampling parameters as RL frameworks send them (the vLLM dictionary), validated up front.

SkyRL and verl build their sampling settings for vLLM and pass the same dictionary to us, so the
keys and their meanings follow vLLM's ``SamplingParams``. This is the one definition: the
``generate`` body validates with it (a 400 naming the key before the op is queued, on every API),
the engines read the validated :class:`SamplingParams`, and every failure names the offending key
(``sampling_params.top_p``, or ``sampling_params[3].top_p`` when one dictionary per prompt is
given) as a :class:`~arctic_platform.contract.problems.FieldError`.

Semantics worth knowing (chosen to match vLLM):

- ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5) means greedy decoding; ``top_p``,
  ``top_k`` and ``min_p`` are then irrelevant.
- ``top_k`` of ``-1`` or ``0`` disables top-k; ``top_p=1`` and ``min_p=0`` disable theirs.
- ``max_tokens=None`` means "up to the model's context length"; the default is 16, like vLLM.
- ``min_tokens`` suppresses the end-of-sequence and ``stop_token_ids`` tokens, and stop strings
  are not looked for, until that many tokens were generated.
- ``ignore_eos`` keeps generating past end-of-sequence tokens (``stop_token_ids`` still stop).
- ``logprobs=k`` returns, for each generated token, its log-probability and the ``k`` most likely
  alternatives (``k=0``: only the sampled token's).
- A key set to ``None`` takes its default (YAML and JSON configs often carry explicit nulls),
  except ``max_tokens``, ``seed`` and ``logprobs``, where ``None`` has the meaning above.

Repetition, presence and frequency penalties are not implemented, so those keys are rejected like
any other unknown key rather than silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from arctic_platform.contract.problems import FieldError, Problem

GREEDY_TEMPERATURE = 1e-5
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class SamplingParams:
    """One request's validated sampling settings (build it with :meth:`from_request`)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_request(cls, value: Any, field: str = "sampling_params") -> SamplingParams:
        """Validate a vLLM-style dictionary (or pass a ``SamplingParams`` through).

        ``None`` gives the defaults. Raises :class:`FieldError` naming ``field.<key>``.
        """
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        if not isinstance(value, Mapping):
            raise FieldError(
                field, f"expected a dictionary of sampling parameters, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise FieldError(
                f"{field}.{unknown[0]}",
                f"unknown sampling parameter(s) {unknown}; supported: {sorted(known)}",
            )
        return cls(**_validated(value, field))


def sampling_params_problem(value: Any) -> Problem | None:
    """A ``generate`` body's ``sampling_params``: one dictionary for every prompt, or a list of
    one per prompt (``None`` entries take the defaults); what is wrong with it, or None. Whether
    a list has one entry per prompt is checked with the prompts (``GenerateBody``, the engines)."""
    entries = [(value, "sampling_params")]
    if isinstance(value, list):
        entries = [(v, f"sampling_params[{i}]") for i, v in enumerate(value)]
    for entry, field in entries:
        try:
            SamplingParams.from_request(entry, field)
        except FieldError as exc:
            return Problem(exc.field, exc.message)
    return None


_NONE_IS_MEANINGFUL = ("max_tokens", "seed", "logprobs")


def _validated(raw: Mapping[str, Any], field: str) -> dict[str, Any]:
    defaults = SamplingParams()
    values = {key: val for key, val in raw.items() if val is not None or key in _NONE_IS_MEANINGFUL}

    def get(key: str) -> Any:
        return values.get(key, getattr(defaults, key))

    def name(key: str) -> str:
        return f"{field}.{key}"

    out: dict[str, Any] = {}
    out["n"] = _int(get("n"), name("n"), minimum=1)
    out["temperature"] = _number(get("temperature"), name("temperature"))
    if out["temperature"] < 0:
        raise FieldError(name("temperature"), f"must be >= 0, got {out['temperature']}")
    out["top_p"] = _number(get("top_p"), name("top_p"))
    if not 0.0 < out["top_p"] <= 1.0:
        raise FieldError(name("top_p"), f"must be in (0, 1], got {out['top_p']}")
    top_k = _int(get("top_k"), name("top_k"), minimum=-1)
    out["top_k"] = -1 if top_k == 0 else top_k
    out["min_p"] = _number(get("min_p"), name("min_p"))
    if not 0.0 <= out["min_p"] <= 1.0:
        raise FieldError(name("min_p"), f"must be in [0, 1], got {out['min_p']}")
    max_tokens = get("max_tokens")
    out["max_tokens"] = None if max_tokens is None else _int(max_tokens, name("max_tokens"), 1)
    out["min_tokens"] = _int(get("min_tokens"), name("min_tokens"), minimum=0)
    if out["max_tokens"] is not None and out["min_tokens"] > out["max_tokens"]:
        raise FieldError(
            name("min_tokens"),
            f"must be <= max_tokens ({out['max_tokens']}), got {out['min_tokens']}",
        )
    out["stop"] = _stop_strings(get("stop"), name("stop"))
    out["stop_token_ids"] = _token_ids(get("stop_token_ids"), name("stop_token_ids"))
    seed = get("seed")
    out["seed"] = None if seed is None else _int(seed, name("seed"))
    logprobs = get("logprobs")
    out["logprobs"] = None if logprobs is None else _int(logprobs, name("logprobs"), minimum=0)
    for key in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
        out[key] = _bool(get(key), name(key))
    return out


def _int(value: Any, field: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise FieldError(field, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise FieldError(field, f"must be >= {minimum}, got {value}")
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(field, f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise FieldError(field, f"must be finite, got {value!r}")
    return float(value)


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"expected true or false, got {value!r}")
    return value


def _stop_strings(value: Any, field: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise FieldError(field, f"expected a string or a list of strings, got {value!r}")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise FieldError(f"{field}[{i}]", f"expected a non-empty string, got {item!r}")
    return tuple(items)


def _token_ids(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise FieldError(field, f"expected a list of token ids, got {value!r}")
    return tuple(_int(item, f"{field}[{i}]", minimum=0) for i, item in enumerate(value))
