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

The reference takes its log-probs against ``roll(input_ids, -1)`` and never realigns a mask, so a
``loss_mask`` aligned with the tokens (a SkyRL shim's response mask) is read as shifted there too:
the mask on a row's last real token scores the token after it, the client's padding id, or, on a
row that fills the width, ``input_ids[:, 0]`` (the roll wraps). The reference trains on those
terms, so this server does the same: the batch gets one more column holding ``input_ids[:, 0]``,
and each such row's attention is extended by that one token (causal attention keeps every earlier
log-prob unchanged). A mask selecting columns further into the padding is refused by the engine,
naming ``batch.loss_mask``. Scalars (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``temperature``, ...) become ``meta``. Context keys this server has no use for (async PPO
``versions``, ...) are refused rather than dropped, so a client never trains an
objective it did not ask for.

The fields built here are numpy arrays (the engine takes numpy or torch per field); a tensor whose
dtype numpy lacks (bf16, float8) is widened to float32, which holds its values exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from arctic_platform import wire
from arctic_platform.contract.ops import OpName
from arctic_platform.server.errors import BadRequest

# Shifted per-token context tensors -> the engine's position-indexed batch fields.
SHIFTED_FIELDS = {
    "advantages": "advantages",
    "loss_mask": "loss_mask",
    "old_log_probs_shifted": "old_log_probs",
    "ref_log_probs_shifted": "ref_log_prob",
    "rollout_is_weights": "rollout_is_weights",
    "sft_mask": "sft_mask",  # ECHO's masks (grpo_echo_v1)
    "echo_observation_mask": "echo_observation_mask",
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
    extend = _rows_scoring_past_their_end(batch, context.get("loss_mask"), op=op)
    for key, value in context.items():
        if key == "input_ids":
            _check_same_ids(batch, value, op=op)
        elif key in SHIFTED_FIELDS:
            name = SHIFTED_FIELDS[key]
            if name in out:
                raise BadRequest(f"{op}: {name} is given both in kwargs and (as {key}) in context")
            out[name] = _unshift(key, value, batch, widen=extend is not None, op=op)
        elif key in SCALAR_FIELDS:
            meta[key] = value
        else:
            known = ", ".join(sorted({"input_ids", *SHIFTED_FIELDS, *SCALAR_FIELDS}))
            raise BadRequest(
                f"{op}: context.{key}: not supported by this server (known context keys: {known})"
            )
    if extend is not None:
        _widen_inputs(out, batch, extend)
    return out, meta


def _is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray) or wire.is_torch_tensor(value)


def _as_array(name: str, value: Any, *, op: str) -> np.ndarray:
    """A tensor (numpy, or torch as the HTTP edges decode it) as a numpy array."""
    if wire.is_torch_tensor(value):
        value = wire.to_numpy(value)
    if not isinstance(value, np.ndarray):
        raise BadRequest(
            f"{op}: context.{name}: expected a [B, S] tensor, got {type(value).__name__}"
        )
    if value.dtype.kind not in "biufc":  # ml_dtypes floats (bf16, float8)
        value = value.astype(np.float32)
    return value


def _check_same_ids(batch: Mapping, value: Any, *, op: str) -> None:
    ids = _as_array("input_ids", value, op=op)
    if "input_ids" not in batch:
        raise BadRequest(f"{op}: kwargs.input_ids: required (context.input_ids is not the input)")
    given = _as_array("input_ids", batch["input_ids"], op=op)
    if ids.shape != given.shape or not np.array_equal(ids.astype(np.int64), given.astype(np.int64)):
        raise BadRequest(f"{op}: context.input_ids differs from kwargs.input_ids")


def _rows_scoring_past_their_end(batch: Mapping, loss_mask: Any, *, op: str) -> np.ndarray | None:
    """The ``[B]`` rows whose shifted ``loss_mask`` selects their last real token (so scores the
    token after it, see module doc), or None when no row does (the batch keeps its width)."""
    if loss_mask is None or "input_ids" not in batch or "attention_mask" not in batch:
        return None
    mask = _as_array("loss_mask", loss_mask, op=op)
    attention = _as_array("attention_mask", batch["attention_mask"], op=op)
    if mask.ndim != 2 or mask.shape != attention.shape:
        return None  # refused with its shape by _unshift
    real = attention.astype(bool)
    columns = np.arange(real.shape[1])
    last = np.where(real, columns, -1).max(axis=1)  # -1: a row without tokens
    at_last = np.take_along_axis(mask.astype(bool), np.clip(last, 0, None)[:, None], axis=1)
    selected = at_last[:, 0] & (last >= 0)
    if not selected.any() and not mask[:, -1].astype(bool).any():
        return None
    if op != OpName.FORWARD_BACKWARD or "labels" in batch:
        raise BadRequest(
            f"{op}: context.loss_mask selects the last token of a row, whose target (the next "
            "token) only a forward-backward without kwargs.labels takes, as the reference does, "
            "from input_ids rolled by one (context tensors are shifted: column i scores "
            "input_ids[:, i+1])"
        )
    return selected  # a mask on the last column of a shorter row: refused by the engine


def _widen_inputs(out: dict, batch: Mapping, extend: np.ndarray) -> None:
    """One more column for the model inputs: ``input_ids[:, 0]`` (the reference's rolled target
    of the last column), attention on it only where a row's own next token is scored (``extend``;
    a shorter row's next token is already in the batch: the client's padding)."""
    shape = tuple(_as_array("input_ids", batch["input_ids"], op=OpName.FORWARD_BACKWARD).shape)
    for name, value in batch.items():
        if not _is_tensor(value) or tuple(value.shape) != shape:
            continue  # not a per-token input
        array = _as_array(name, value, op=OpName.FORWARD_BACKWARD)
        if name == "input_ids":
            column = array[:, :1]
        elif name == "position_ids":
            column = array[:, -1:] + 1
        else:
            column = np.zeros_like(array[:, :1])
        widened = np.concatenate([array, column], axis=1)
        if name == "attention_mask":
            real = array.astype(bool)
            after_last = real.astype(np.int64).cumsum(1).argmax(1) + 1  # after each row's last
            widened[extend, after_last[extend]] = 1
        out[name] = widened


def _unshift(name: str, value: Any, batch: Mapping, *, widen: bool, op: str) -> np.ndarray:
    """Shifted ``[B, S]`` -> position-indexed (column ``i`` moves to ``i + 1``): ``[B, S + 1]``
    when ``widen`` (a row scores past its end, see module doc), else ``[B, S]``."""
    shifted = _as_array(name, value, op=op)
    ids = batch.get("input_ids")
    width = None if ids is None else tuple(ids.shape)
    if shifted.ndim != 2 or (width is not None and tuple(shifted.shape) != width):
        raise BadRequest(
            f"{op}: context.{name}: expected shape {list(width or ['B', 'S'])} like input_ids, "
            f"got {list(shifted.shape)}"
        )
    if name == "loss_mask" and (
        np.iscomplexobj(shifted) or not ((shifted == 0) | (shifted == 1)).all()
    ):
        raise BadRequest(f"{op}: context.loss_mask: must be binary (0 or 1)")
    rows, columns = shifted.shape
    out = np.zeros((rows, columns + 1), dtype=shifted.dtype)
    out[:, 1:] = shifted
    return out if widen else out[:, :columns].copy()
