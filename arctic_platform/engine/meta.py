"""What travels beside a batch: ``meta`` (global sizes, temperature, loss knobs) and ``processing``.

Both arrive from the wire as plain dicts, sometimes with scalars wrapped in 0-d tensors or numpy
values (verl sends ``batch_num_tokens`` as ``response_mask.sum()``). They are parsed once, with
errors that name the field, so the forward and loss code reads typed values: ``meta`` here,
``processing`` by the contract (:mod:`arctic_platform.contract.processing`, torch-free, which the
server's edge also runs), and :func:`parse_request` does both.

``meta`` keys the engine does not use (verl sends ``rollout_n``, ``zorro_train_enable``,
``max_token_len_per_gpu``, ...) are accepted and ignored; the keys below are type-checked. So is
the per-call ``logits_optimization`` (SkyRL always sends ``none``): whether the LM head runs in
chunks is the job's ``logits`` setting, and the numbers are the same either way.

**One knob for entropy**: ``meta.calculate_entropy``. Two older spellings are still accepted on
the wire and folded into it by :func:`parse_request`, the one place that knows them:
``processing.config.calculate_entropy`` (wins when given) and naming
``compute_entropy_and_logprobs`` in an explicit ``processing.post`` (asks for entropies when
neither flag is given). Everything after the fold reads only :attr:`Meta.calculate_entropy`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from arctic_platform.contract.processing import (
    ENTROPY_AND_LOGPROBS,
    Processing,
    parse_processing,
)
from arctic_platform.engine.errors import EngineInputError


@dataclass(frozen=True)
class Meta:
    """Typed ``meta``.

    ``batch_num_tokens`` and ``global_batch_size`` are the *global* loss-token and sequence counts
    across data-parallel workers; ``None`` means "this batch's own", which is only correct with one
    worker (checked where a loss needs them).
    """

    dp_size: int = 1
    batch_num_tokens: float | None = None
    global_batch_size: int | None = None
    temperature: float = 1.0
    calculate_entropy: bool | None = None
    pad_token_id: int | None = None
    max_response_len: int | None = None
    actor_config: Mapping[str, Any] = field(default_factory=dict)
    policy_loss_config: Mapping[str, Any] = field(default_factory=dict)


def parse_request(
    meta: Mapping | None, processing: Mapping | None, *, default_loss: str | None
) -> tuple[Meta, Processing]:
    """``meta`` and ``processing`` checked and typed, the entropy request folded into
    ``meta.calculate_entropy`` (see module doc)."""
    parsed_meta = parse_meta(meta)
    parsed_processing = parse_processing(processing, default_loss=default_loss)
    asked = parsed_processing.config.get("calculate_entropy")
    if asked is not None:
        asked = to_bool("processing.config.calculate_entropy", asked)
    else:
        asked = parsed_meta.calculate_entropy
    if asked is None and isinstance(processing, Mapping) and processing.get("post") is not None:
        asked = ENTROPY_AND_LOGPROBS in parsed_processing.post or None
    return replace(parsed_meta, calculate_entropy=asked), parsed_processing


def parse_meta(meta: Mapping | None) -> Meta:
    """Check and type the keys of ``meta`` the engine reads."""
    if meta is None:
        return Meta()
    if not isinstance(meta, Mapping):
        raise EngineInputError("meta", f"expected a dict, got {type(meta).__name__}")
    if meta.get("rollout_is_weights") is not None:
        raise EngineInputError(
            "meta.rollout_is_weights",
            "send rollout importance weights as batch.rollout_is_weights, shaped [B, S] like the "
            "other per-token fields",
        )

    get = option_reader(meta, "meta")
    temperature = get("temperature", to_float, 1.0)
    if not temperature > 0:
        raise EngineInputError("meta.temperature", f"must be > 0, got {temperature}")
    batch_num_tokens = get("batch_num_tokens", to_float, None)
    if batch_num_tokens is not None and not batch_num_tokens > 0:
        raise EngineInputError("meta.batch_num_tokens", f"must be > 0, got {batch_num_tokens}")
    return Meta(
        dp_size=get("dp_size", to_int, 1, minimum=1),
        batch_num_tokens=batch_num_tokens,
        global_batch_size=get("global_batch_size", to_int, None, minimum=1),
        temperature=temperature,
        calculate_entropy=get("calculate_entropy", to_bool, None),
        pad_token_id=get("pad_token_id", to_int, None, minimum=0),
        max_response_len=get("max_response_len", to_int, None, minimum=1),
        actor_config=_mapping(meta, "actor_config"),
        policy_loss_config=_mapping(meta, "policy_loss_config"),
    )


# -- scalar conversion (wire scalars may be 0-d tensors or numpy values) ----------------------


def _scalar(field_name: str, value):
    if isinstance(value, (torch.Tensor, np.ndarray)):
        count = value.size if isinstance(value, np.ndarray) else value.numel()
        if count == 1:
            return value.reshape(()).item()
        raise EngineInputError(field_name, f"expected a scalar, got shape {list(value.shape)}")
    if isinstance(value, np.generic):
        return value.item()
    return value


def option_reader(options: Mapping, prefix: str):
    """``get(name, convert, default, **kw)`` over ``options``: a missing or None value gives
    ``default`` (frameworks send None for "their default"), anything else goes through
    ``convert``, whose errors name ``<prefix>.<name>``."""

    def get(name: str, convert, default, **kw):
        value = options.get(name)
        return default if value is None else convert(f"{prefix}.{name}", value, **kw)

    return get


def to_float(field_name: str, value, *, minimum: float | None = None) -> float:
    value = _scalar(field_name, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EngineInputError(field_name, f"expected a number, got {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise EngineInputError(field_name, f"must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise EngineInputError(field_name, f"must be >= {minimum}, got {value}")
    return value


def to_int(field_name: str, value, *, minimum: int | None = None) -> int:
    value = _scalar(field_name, value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EngineInputError(field_name, f"expected an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise EngineInputError(field_name, f"must be >= {minimum}, got {value}")
    return value


def to_bool(field_name: str, value) -> bool:
    value = _scalar(field_name, value)
    if not isinstance(value, bool):
        raise EngineInputError(field_name, f"expected true or false, got {value!r}")
    return value


def to_str(field_name: str, value) -> str:
    if not isinstance(value, str):
        raise EngineInputError(field_name, f"expected a string, got {value!r}")
    return value


def _mapping(meta: Mapping, name: str) -> Mapping[str, Any]:
    value = meta.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise EngineInputError(f"meta.{name}", f"expected a dict, got {type(value).__name__}")
    return value
