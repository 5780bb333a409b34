"""The rules on op body values that several edges apply, and the tensor envelopes' keys.

Each op's body model sits beside its row in :mod:`arctic_platform.contract.ops` (one place per
op); the rules here are the ones that the engines apply too, so they live apart from any one model.
Tensor envelopes (forward-backward, forward) are described by :data:`TRAIN_ENVELOPE_KEYS` and
:data:`SNOWAPI_ENVELOPE_KEYS`, which the client checks before sending and the server on receipt.

Values that every edge checks are ruled on here once: :func:`learning_rate_problem`,
:func:`prompts_problem` and :func:`context_problem` (a sequence against the model's context, which
the engine knows) say what is wrong with a value (or None), and each edge raises that in its
own kind: the body models as a validation error (a 400 naming the field), the client as a
``TypeError``/``ValueError`` before anything is sent, the engines (called in process, e.g. by the
Tinker API) as a :class:`~arctic_platform.contract.problems.FieldError`. Nothing else keeps a copy
of these rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from arctic_platform.contract.problems import Problem

# The tensor envelope of forward-backward / forward: the on-prem (verl) form and the SnowAPI form.
TRAIN_ENVELOPE_KEYS = frozenset({"batch", "meta", "processing", "router_replay", "reference_model"})
SNOWAPI_ENVELOPE_KEYS = frozenset(
    {"args", "kwargs", "context", "meta", "processing", "reference_model"}
)


def learning_rate_problem(value: Any) -> Problem | None:
    """A step's ``learning_rate``: None (keep the current one) or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return Problem("learning_rate", f"must be a number, got {value!r}", wrong_type=True)
    if not math.isfinite(value) or value <= 0:
        return Problem("learning_rate", f"must be > 0, got {value!r}")
    return None


def load_source_problem(path: Any, checkpoint_id: Any) -> Problem | None:
    """A load names its checkpoint by folder (``path``) or by ``checkpoint_id``, never both."""
    if path is not None and checkpoint_id is not None:
        return Problem("checkpoint_id", "and path both given: give path or checkpoint_id, not both")
    return None


def prompts_problem(prompts: Any, *, name: str = "prompts") -> Problem | None:
    """``generate``/``log_probs`` prompts: a non-empty list of strings or non-empty lists of
    token ids (the engine then checks ids against its vocabulary)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        return Problem(
            name,
            "must be a list of strings or token-id lists (wrap a single prompt in a list), "
            f"got {type(prompts).__name__}",
            wrong_type=True,
        )
    if not prompts:
        return Problem(name, "is empty")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            continue
        if (
            not isinstance(prompt, (list, tuple))
            or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return Problem(
                f"{name}[{i}]",
                f"must be a string or a non-empty list of token ids, got {type(prompt).__name__}",
                wrong_type=True,
            )
    return None


def context_problem(field: str, what: str, tokens: int, context: int) -> Problem | None:
    """A sequence the model sees whole (a training row, a prompt with its completion or its new
    tokens) must fit the model's context: ``tokens`` at most ``context``. Beyond it a forward costs
    quadratic time in a length nothing bounds (a 10^6-token row ran for hours), so every engine
    and the server's submit path refuse it with this one message."""
    if tokens <= context:
        return None
    return Problem(
        field, f"{what} is {tokens} tokens, more than the model's context of {context} tokens"
    )


def longest_row_problem(
    batch: Any, context: int, *, field: str, what: str = "row {row}"
) -> Problem | None:
    """:func:`context_problem` for the longest row of a ``[B, S]`` batch (numpy arrays or CPU
    torch tensors): its real tokens, from ``attention_mask`` (every column without one), are what
    the model runs over, so padding never counts against the context. ``field`` and ``what`` may
    name the row as ``{row}``."""
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask", batch.get("input_ids"))
    shape = getattr(mask, "shape", ())
    if len(shape) != 2 or 0 in shape:
        return None  # the engine's validation names what is wrong with it
    if "attention_mask" in batch:
        lengths = np.count_nonzero(np.asarray(mask), axis=1)
    else:
        lengths = np.full(shape[0], shape[1])
    row = int(lengths.argmax())
    return context_problem(field.format(row=row), what.format(row=row), int(lengths[row]), context)


def ruled_by(problem_of: Callable[[Any], Problem | None]) -> BeforeValidator:
    """A body model's field validator that applies a rule (its message, the field's path): one of
    the rules above, or an op's own beside its model in :mod:`arctic_platform.contract.ops`."""

    def check(value: Any) -> Any:
        problem = problem_of(value)
        if problem is not None:
            raise PydanticCustomError("invalid_value", "{problem}", {"problem": str(problem)})
        return value

    return BeforeValidator(check)
