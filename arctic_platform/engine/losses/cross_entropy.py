"""``cross_entropy``: supervised fine-tuning, ``-log p(target)`` per target token.

Targets follow the HF convention: ``labels[:, i]`` is the token at position ``i``, predicted from
the tokens before it; ``-100`` marks positions without a target. A label on a sequence's first token
is ignored (nothing precedes it), as HF does for column 0. Without ``labels``, the targets are the
``input_ids`` where ``loss_mask`` (or ``response_mask``) is 1. With ``loss_weights`` (``[B, S]``
float), each target's term is ``-log p(target) * weight`` (Tinker's weighted cross-entropy; a
custom loss's gradient arrives as such weights).

The default aggregation is ``token-mean`` over the global target count (``meta.batch_num_tokens``
when several workers share a batch); ``processing.config`` ``loss_agg_mode`` picks another. Metric:
``loss`` (mean negative log-likelihood per target token).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from arctic_platform.contract.batch_layout import IGNORE_INDEX
from arctic_platform.contract.processing import CROSS_ENTROPY
from arctic_platform.engine.batching import Batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.losses.aggregation import config_aggregation
from arctic_platform.engine.losses.base import LossOutput, masked_sum, register_loss
from arctic_platform.engine.meta import Meta


@register_loss(CROSS_ENTROPY)
class CrossEntropyLoss:
    """``cross_entropy`` bound to one request (see module doc)."""

    needs_entropy = False

    def __init__(self, batch: Batch, meta: Meta, config: Mapping[str, Any]) -> None:
        if batch.has("labels"):
            labels = batch.get("labels")
            used = labels != IGNORE_INDEX
            mask = used & batch.scorable()
            self.targets = torch.where(used, labels, batch.input_ids)
        else:
            name = next((n for n in ("loss_mask", "response_mask") if batch.has(n)), None)
            if name is None:
                raise EngineInputError(
                    "batch.labels",
                    "missing; cross_entropy needs labels, loss_mask or response_mask",
                )
            mask = batch.get(name)
            batch.check_loss_mask(name, mask)
            self.targets = None
        self.tensors = {"mask": mask}
        self.reads = mask
        if batch.has("loss_weights"):
            batch.check_finite("loss_weights", mask)
            self.tensors["weights"] = batch.get("loss_weights")
        self.agg = config_aggregation(config, "token-mean", meta=meta, batch=batch, mask=mask)

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        mask = rows["mask"]
        nll = -outputs["logprobs"]
        if "weights" in rows:
            nll = nll * rows["weights"]
        metrics = {"loss.sum": masked_sum(nll, mask), "loss.tokens": mask.sum().float()}
        return LossOutput(loss=self.agg(nll, mask), metrics=metrics)
