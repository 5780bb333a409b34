"""The SnowAPI ``context`` of a forward-backward request, mapped into the engine's batch layout.

The reference's Cortex dispatch sends ``{args: [], kwargs: {input_ids, attention_mask, ...},
context: {input_ids, advantages, loss_mask, ...}, processing: {post: ["compute_logprobs"],
loss_fn: "grpo", config: {...}}}``. ``kwargs`` holds the model inputs; ``context`` holds what the
loss reads: per-token tensors and scalars.

Per-token context tensors follow the SnowAPI *shifted* convention, the layout of the log-probs
``compute_logprobs`` produces: column ``i`` belongs to the prediction of ``input_ids[:, i + 1]``.
The engine's batch is position-indexed (column ``i`` belongs to ``input_ids[:, i]``), so each one
is moved one column right here, once, and renamed to the engine's field
(``old_log_probs_shifted`` -> ``old_log_probs``, ``ref_log_probs_shifted`` -> ``ref_log_prob``).
A shifted mask that selects the last column would score a token past the end of the row; that is
refused, naming the field. Scalars (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``temperature``, ...) become ``meta``. Context keys this server has no use for (async PPO
``versions``, ECHO masks, ...) are refused rather than dropped, so a client never trains an
objective it did not ask for.

The moved fields are numpy arrays (the engine takes numpy or torch per field); a tensor whose
dtype numpy lacks (bf16, float8) is widened to float32, which holds its values exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from arctic_platform import wire
from arctic_platform.server.errors import BadRequest

# Shifted per-token context tensors -> the engine's position-indexed batch fields.
SHIFTED_FIELDS = {
    "advantages": "advantages",
    "loss_mask": "loss_mask",
    "old_log_probs_shifted": "old_log_probs",
    "ref_log_probs_shifted": "ref_log_prob",
    "rollout_is_weights": "rollout_is_weights",
}
# Scalars the engine reads from meta.
SCALAR_FIELDS = frozenset(
    {"dp_size", "batch_num_tokens", "global_batch_size", "temperature", "calculate_entropy"}
)


def context_into_batch(
    batch: Mapping, context: Mapping, *, op: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(batch, meta)``: ``batch`` plus the context's per-token fields, and its scalars."""
    out = dict(batch)
    meta: dict[str, Any] = {}
    for key, value in context.items():
        if key == "input_ids":
            _check_same_ids(batch, value, op=op)
        elif key in SHIFTED_FIELDS:
            name = SHIFTED_FIELDS[key]
            if name in out:
                raise BadRequest(f"{op}: {name} is given both in kwargs and (as {key}) in context")
            out[name] = _unshift(key, value, batch, op=op)
        elif key in SCALAR_FIELDS:
            meta[key] = value
        else:
            known = ", ".join(sorted({"input_ids", *SHIFTED_FIELDS, *SCALAR_FIELDS}))
            raise BadRequest(
                f"{op}: context.{key}: not supported by this server (known context keys: {known})"
            )
    return out, meta


def _as_array(name: str, value: Any, *, op: str) -> np.ndarray:
    """A context tensor (numpy, or torch as the HTTP edges decode it) as a numpy array."""
    if wire.is_torch_tensor(value):
        value = wire.to_numpy(value)
    if not isinstance(value, np.ndarray):
        raise BadRequest(
            f"{op}: context.{name}: expected a [B, S] tensor, got {type(value).__name__}"
        )
    if value.dtype.kind not in "biuf":  # ml_dtypes floats (bf16, float8)
        value = value.astype(np.float32)
    return value


def _check_same_ids(batch: Mapping, value: Any, *, op: str) -> None:
    ids = _as_array("input_ids", value, op=op)
    if "input_ids" not in batch:
        raise BadRequest(f"{op}: kwargs.input_ids: required (context.input_ids is not the input)")
    given = _as_array("input_ids", batch["input_ids"], op=op)
    if ids.shape != given.shape or not np.array_equal(ids.astype(np.int64), given.astype(np.int64)):
        raise BadRequest(f"{op}: context.input_ids differs from kwargs.input_ids")


def _unshift(name: str, value: Any, batch: Mapping, *, op: str) -> np.ndarray:
    """Shifted ``[B, S]`` -> position-indexed ``[B, S]`` (column ``i`` moves to ``i + 1``)."""
    shifted = _as_array(name, value, op=op)
    ids = batch.get("input_ids")
    width = None if ids is None else tuple(ids.shape)
    if shifted.ndim != 2 or (width is not None and tuple(shifted.shape) != width):
        raise BadRequest(
            f"{op}: context.{name}: expected shape {list(width or ['B', 'S'])} like input_ids, "
            f"got {list(shifted.shape)}"
        )
    selects_last = name == "loss_mask" and bool(shifted[:, -1].astype(bool).any())
    if selects_last:
        raise BadRequest(
            f"{op}: context.loss_mask selects the last column, which would score a token past "
            "the end of the row (context tensors are shifted: column i scores input_ids[:, i+1])"
        )
    out = np.zeros_like(shifted)
    out[:, 1:] = shifted[:, :-1]
    return out
