"""verl's actor loss (``verl_grpo``) with verl-shaped entry points.

The math lives once, in the engine's loss registry (``arctic_platform.engine.losses``:
``verl_grpo`` with ``aggregation`` and ``kl``): that is what the server runs when a client sends
``processing={"loss_fn": "verl_grpo"}``. This module gives code written against verl (or against
the earlier ``arctic_platform.rl`` processor) the same objective under verl's names and signatures:

* :func:`verl_grpo_loss` ``(model_outputs, batch, meta, config) -> (loss, metrics)``: the whole
  objective of one batch in the DESIGN.md §3 layout (position-indexed ``[B, S]`` tensors), every
  knob read from ``meta["actor_config"]``, metrics as global token means under verl's names;
* :func:`agg_loss`, :func:`kl_penalty`, :func:`kl_penalty_forward`: verl's ``core_algos``
  signatures over any ``[B, T]`` loss matrix and mask.

:mod:`arctic_platform.rl.processors.verl_grpo` re-exports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from arctic_platform._extras import require

require("torch", "engine", purpose="the verl_grpo loss")

import torch  # noqa: E402

from arctic_platform.engine.batching import validate_batch  # noqa: E402
from arctic_platform.engine.losses.aggregation import (  # noqa: E402
    AGG_MODES,
    Aggregation,
    check_agg_mode,
)
from arctic_platform.engine.losses.kl import KL_TYPES, check_kl_type  # noqa: E402
from arctic_platform.engine.losses.kl import kl_penalty as _engine_kl_penalty  # noqa: E402
from arctic_platform.engine.losses.verl_grpo import (  # noqa: E402
    LOSS_NAME,
    ActorLossConfig,
    VerlGrpoLoss,
    parse_actor_config,
)
from arctic_platform.engine.meta import parse_meta  # noqa: E402
from arctic_platform.engine.metrics import MetricSums  # noqa: E402

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "LOSS_NAME",
    "ActorLossConfig",
    "VerlGrpoLoss",
    "agg_loss",
    "kl_penalty",
    "kl_penalty_forward",
    "parse_actor_config",
    "verl_grpo_loss",
]


def verl_grpo_loss(
    model_outputs: Mapping[str, torch.Tensor],
    batch: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The ``verl_grpo`` objective of ``batch`` and its metrics.

    ``model_outputs["logprobs"]`` (and ``"entropy"``, used for the entropy bonus when present) are
    ``[B, S]`` and position-indexed like the batch's per-token fields; gradients flow into them.
    ``meta`` is what travels beside a batch (``actor_config`` with verl's loss knobs,
    ``batch_num_tokens``, ``global_batch_size``, ``dp_size``); ``config`` is
    ``processing.config``. Bad input raises the engine's input error naming the field.
    """
    prepared = VerlGrpoLoss(validate_batch(batch), parse_meta(meta), config or {})
    output = prepared(model_outputs, prepared.tensors)
    sums = MetricSums()
    sums.add(output.metrics)
    return output.loss, sums.finalize()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: float | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """verl's ``agg_loss``: one number from a ``[B, T]`` loss matrix and its 0/1 mask.

    The global counts default to this batch's (tokens under the mask; sequences with any token),
    which is only right for one worker, so with ``dp_size > 1`` a missing count is an error, as in
    verl. ``loss_scale_factor`` defaults to ``T``.
    """
    check_agg_mode("loss_agg_mode", loss_agg_mode)
    mask = loss_mask.bool()
    if not torch.equal(mask.to(loss_mask.dtype), loss_mask):
        raise ValueError("loss_mask: expected 0/1 values")
    if dp_size > 1:
        needed = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
        given = batch_num_tokens if needed == "batch_num_tokens" else global_batch_size
        if loss_agg_mode != "token-sum" and given is None:
            raise ValueError(f"{needed}: required when dp_size > 1 (the global count)")
    if batch_num_tokens is None:
        batch_num_tokens = float(mask.sum())
    if global_batch_size is None:
        global_batch_size = int(mask.any(-1).sum())
    scale = float(loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    aggregate = Aggregation(
        loss_agg_mode, int(dp_size), float(batch_num_tokens), int(global_batch_size), scale
    )
    return aggregate(loss_mat, mask)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl's ``kl_penalty``: per-token KL estimate; a ``+`` suffix is the straight-through
    variant (the base estimator's value, the gradient of k2)."""
    return _engine_kl_penalty(logprob, ref_logprob, check_kl_type("kl_penalty", kl_penalty))


def kl_penalty_forward(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str
) -> torch.Tensor:
    """verl's ``kl_penalty_forward``: the base estimator alone (a ``+`` suffix is ignored)."""
    base = check_kl_type("kl_penalty", kl_penalty).rstrip("+")
    return _engine_kl_penalty(logprob, ref_logprob, base)
