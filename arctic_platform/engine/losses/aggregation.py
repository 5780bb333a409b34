"""Loss aggregation modes: how a per-token loss matrix becomes one number.

The modes are verl's (``loss_agg_mode``), with verl's global normalisation so the result does not
depend on how a batch is split into microbatches or data-parallel shards:

* ``token-mean``: ``sum(L * m) / N_tok * dp``
* ``token-sum``: ``sum(L * m) * dp``
* ``seq-mean-token-sum``: ``sum_seq(sum_tok L * m) / G * dp``
* ``seq-mean-token-sum-norm``: the same, divided by ``loss_scale_factor`` (default: the response
  horizon, see :func:`make_aggregation`)
* ``seq-mean-token-mean``: ``sum_seq(sum_tok L * m / (sum_tok m + 1e-8)) / G * dp``

``N_tok`` (``meta.batch_num_tokens``) and ``G`` (``meta.global_batch_size``) are global counts over
all workers. Each microbatch's value is its share of the global objective, so the shares add up
over microbatches; the ``* dp`` factor undoes the average a data-parallel all-reduce takes over
workers, so the gradient every worker ends with is that of the objective over the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from arctic_platform.engine.batching import Batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.meta import Meta, to_str

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


@dataclass(frozen=True)
class Aggregation:
    """A loss aggregation bound to the global counts of one request."""

    mode: str
    dp_size: int
    num_tokens: float
    num_seqs: int
    scale_factor: float

    def __call__(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of the objective; ``values`` and ``mask`` are ``[b, S]``."""
        masked = torch.where(
            mask, values, torch.zeros((), dtype=values.dtype, device=values.device)
        )
        if self.mode == "token-mean":
            return masked.sum() / self.num_tokens * self.dp_size
        if self.mode == "token-sum":
            return masked.sum() * self.dp_size
        per_seq = masked.sum(-1)
        if self.mode == "seq-mean-token-mean":
            per_seq = per_seq / (mask.sum(-1) + 1e-8)
        total = per_seq.sum() / self.num_seqs * self.dp_size
        if self.mode == "seq-mean-token-sum-norm":
            total = total / self.scale_factor
        return total


def check_agg_mode(field: str, mode) -> str:
    if mode not in AGG_MODES:
        raise EngineInputError(
            field, f"unknown loss_agg_mode {mode!r}; known: {', '.join(AGG_MODES)}"
        )
    return mode


def make_aggregation(
    mode: str,
    *,
    field: str,
    meta: Meta,
    batch: Batch,
    mask: torch.Tensor,
    scale_factor: float | None = None,
) -> Aggregation:
    """Bind ``mode`` to the request's global counts, defaulting them to this batch's own.

    With ``dp_size > 1`` a missing global count is an error: each worker would otherwise normalise
    by its own shard and the gradients would not be the global ones. ``scale_factor`` defaults to
    the response horizon (the width of the response part: ``meta.max_response_len``, else the
    width of ``batch.responses``, else ``S`` minus the width of ``batch.prompts``, else ``S``),
    which is what verl's ``[B, R]`` response tensors give as ``loss_mask.shape[-1]``.
    """
    check_agg_mode(field, mode)
    if meta.dp_size > 1:
        needed = "batch_num_tokens" if mode == "token-mean" else "global_batch_size"
        if mode != "token-sum" and getattr(meta, needed) is None:
            raise EngineInputError(
                f"meta.{needed}", f"required with dp_size={meta.dp_size} for loss_agg_mode {mode}"
            )
    num_tokens = meta.batch_num_tokens
    if num_tokens is None:
        num_tokens = max(float(mask.sum()), 1.0)
    num_seqs = meta.global_batch_size or batch.size
    if scale_factor is None:
        scale_factor = float(_horizon(batch, meta))
    elif not scale_factor > 0:
        raise EngineInputError(f"{field}.loss_scale_factor", f"must be > 0, got {scale_factor}")
    return Aggregation(mode, meta.dp_size, float(num_tokens), int(num_seqs), float(scale_factor))


def config_aggregation(
    config: Mapping[str, Any], default: str, *, meta: Meta, batch: Batch, mask: torch.Tensor
) -> Aggregation:
    """The aggregation ``processing.config`` names in ``loss_agg_mode`` (``default`` if unset)."""
    field = "processing.config.loss_agg_mode"
    mode = config.get("loss_agg_mode")
    mode = default if mode is None else to_str(field, mode)
    return make_aggregation(mode, field=field, meta=meta, batch=batch, mask=mask)


def _horizon(batch: Batch, meta: Meta) -> int:
    if meta.max_response_len is not None:
        return meta.max_response_len
    if batch.has("responses"):
        return int(batch.get("responses").shape[1])
    if batch.has("prompts"):
        return batch.seq_len - int(batch.get("prompts").shape[1])
    return batch.seq_len
