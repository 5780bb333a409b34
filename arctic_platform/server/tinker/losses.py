"""Tinker's built-in losses on our engine: datums -> a position-indexed batch, and back.

A Tinker datum holds ``model_input`` tokens ``x[0..N)`` and per-target inputs of length ``N``:
``target_tokens[j]`` is scored given ``x[0..j]``. Our engines index per-token fields by the
position of the scored token, so a datum becomes one row of ``N + 1`` tokens (``x`` followed by the
last target) with ``labels[j + 1] = target_tokens[j]``, and every other per-target input shifted by
one the same way. Rows are right-padded to the longest datum.

Each Tinker loss maps onto the engine loss of the same math (all token sums, as Tinker computes
them; ``r = exp(logp - logprobs)``, ``A = advantages``):

* ``cross_entropy``: ``sum(-logp * weights)`` (engine ``cross_entropy`` with ``loss_weights``)
* ``importance_sampling``: ``-sum(r A)``
* ``ppo``: ``-sum(min(r A, clip(r, clip_low_threshold, clip_high_threshold) A))``
* ``cispo``: ``-sum(sg(clip(r, lo, hi)) logp A)``
* ``dro``: ``-sum(logp A - beta/2 (logp - logprobs)^2)``

Every target position is scored, prompt positions included (their advantages are 0 in the
cookbook's datums), as Tinker does. The ``loss:sum`` metric is the summed loss.

A datum does not say where its prompt ends, but its loss inputs show it: the cookbook (and any
GRPO loop) puts zeros in every float input (``weights``, or ``logprobs`` and ``advantages``) over
the prompt. The batch's ``response_mask`` marks the positions from the first nonzero one on, which
is what the engine's prompt sharing (:mod:`arctic_platform.engine.prompt_sharing`) reads to run a
prompt shared by several datums once; which positions train stays ``loss_mask``/``loss_weights``.
Sharing is exact for any split point (a row's prompt is only shared with rows whose tokens and
targets before it are equal), so a datum whose prompt carries nonzero inputs only shares less.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from arctic_platform import wire
from arctic_platform.contract.batch_layout import IGNORE_INDEX
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.tinker.codec import Datum

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class TinkerLoss:
    """The ``loss_fn_inputs`` a Tinker loss needs and the ``loss_fn_config`` keys it accepts."""

    inputs: tuple[str, ...]
    config_keys: tuple[str, ...] = ()


LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": TinkerLoss(("target_tokens", "weights")),
    "importance_sampling": TinkerLoss(_RL_INPUTS),
    "ppo": TinkerLoss(_RL_INPUTS, _CLIP_KEYS),
    "cispo": TinkerLoss(_RL_INPUTS, _CLIP_KEYS),
    "dro": TinkerLoss(_RL_INPUTS, ("beta",)),
}
# loss_fn_inputs -> engine batch field (position-indexed); target_tokens become labels.
_FIELDS = {
    "weights": "loss_weights",
    "logprobs": "old_log_probs",
    "advantages": "advantages",
}


def check_loss(loss_fn: str, config: dict) -> TinkerLoss:
    """The loss ``loss_fn`` names, with ``config`` holding only keys it accepts (400 otherwise)."""
    spec = LOSSES.get(loss_fn)
    if spec is None:
        known = ", ".join(sorted(LOSSES))
        raise BadRequest(f"loss_fn: unknown loss {loss_fn!r}; known: {known}", field="loss_fn")
    for key, value in config.items():
        if key not in spec.config_keys:
            accepted = ", ".join(spec.config_keys) or "none"
            raise BadRequest(
                f"loss_fn_config.{key}: not a {loss_fn} setting (accepted: {accepted})",
                field=f"loss_fn_config.{key}",
            )
        if isinstance(value, str):
            raise BadRequest(
                f"loss_fn_config.{key}: expected a number, got {value!r}",
                field=f"loss_fn_config.{key}",
            )
    return spec


def processing_for(loss_fn: str, config: dict) -> dict:
    """The engine ``processing`` of a Tinker loss: the same-named engine loss, token-summed."""
    return {"loss_fn": loss_fn, "config": {"loss_agg_mode": "token-sum", **config}}


def batch_shape(data: list[Datum]) -> tuple[int, int]:
    """``(rows, width)`` of the batch :func:`build_batch` makes of ``data`` (a row of ``N + 1``
    tokens per datum, module doc), known before the batch exists so that the server's limits
    are checked first."""
    if not data:
        raise BadRequest("data: no datums given", field="data")
    return len(data), max(d.tokens.size for d in data) + 1


def check_vocabulary(data: list[Datum], vocab_size: int) -> None:
    """A 400 naming the datum whose ``model_input`` or ``target_tokens`` holds an id outside the
    model's vocabulary (the engine would name only the batch it built of them)."""
    for i, datum in enumerate(data):
        for where, ids in (
            ("model_input", datum.tokens),
            ("loss_fn_inputs.target_tokens", datum.inputs.get("target_tokens")),
        ):
            if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise BadRequest(
                    f"data[{i}].{where}: token ids must lie in [0, {vocab_size}) (the model's "
                    "vocabulary)",
                    field=f"data[{i}].{where}",
                )


def build_batch(data: list[Datum], spec: TinkerLoss) -> dict[str, np.ndarray]:
    """The engine batch of ``data`` as numpy arrays (see module doc); a datum missing an input is
    a 400."""
    rows, width = batch_shape(data)
    lengths = []
    for i, datum in enumerate(data):
        n = datum.tokens.size
        if n == 0:
            raise BadRequest(f"data[{i}].model_input: empty", field=f"data[{i}].model_input")
        for name in spec.inputs:
            value = datum.inputs.get(name)
            if value is None:
                where = f"data[{i}].loss_fn_inputs.{name}"
                raise BadRequest(f"{where}: missing; the loss needs it", field=where)
            if value.shape != (n,):
                raise BadRequest(
                    f"data[{i}].loss_fn_inputs.{name}: expected shape [{n}] (one per model_input "
                    f"token), got {list(value.shape)}",
                    field=f"data[{i}].loss_fn_inputs.{name}",
                )
        lengths.append(n)
    input_ids = np.zeros((rows, width), dtype=np.int64)
    attention_mask = np.zeros((rows, width), dtype=np.int64)
    labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int64)
    fields = {
        _FIELDS[name]: np.zeros((rows, width), dtype=np.float32)
        for name in spec.inputs
        if name in _FIELDS
    }
    for i, (datum, n) in enumerate(zip(data, lengths, strict=True)):
        targets = datum.inputs["target_tokens"].astype(np.int64)
        input_ids[i, :n] = datum.tokens
        input_ids[i, n] = targets[-1]
        attention_mask[i, : n + 1] = 1
        labels[i, 1 : n + 1] = targets
        for name, field in _FIELDS.items():
            if field in fields:
                fields[field][i, 1 : n + 1] = datum.inputs[name].astype(np.float32)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **fields}
    if "loss_weights" not in fields:
        batch["loss_mask"] = labels != IGNORE_INDEX
    batch["response_mask"] = _from_first_nonzero(fields.values(), attention_mask)
    return batch


def _from_first_nonzero(fields, attention_mask: np.ndarray) -> np.ndarray:
    """1 on each row's tokens from its first position where any of ``fields`` is nonzero on
    (module doc)."""
    nonzero = np.logical_or.reduce([f != 0 for f in fields])
    return (np.logical_or.accumulate(nonzero, axis=1) & (attention_mask == 1)).astype(np.int64)


def per_datum(logprobs, lengths: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Each datum's target log-probs (``[N]``, ``N`` its ``lengths`` entry: its model_input's
    tokens) from the engine's position-indexed ``[B, S]`` (a torch tensor or numpy array)."""
    if wire.is_torch_tensor(logprobs):
        logprobs = wire.to_numpy(logprobs.detach().cpu())
    return [
        {"logprobs": np.asarray(logprobs[i, 1 : n + 1], dtype=np.float32)}
        for i, n in enumerate(lengths)
    ]


def loss_metrics(raw: dict[str, float]) -> dict[str, float]:
    """Tinker's metrics (``name:reduction``) from the engine's raw metric sums."""
    return {"loss:sum": float(raw.get("loss.sum", 0.0))}
