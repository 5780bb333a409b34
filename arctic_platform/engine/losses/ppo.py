"""Tinker's policy losses: ``importance_sampling``, ``ppo``, ``cispo`` and ``dro``.

With ``r = exp(clamp(logp - old, -20, 20))`` (``old`` is the batch's ``old_log_probs``, or the
current log-probs detached in the on-policy form, see
:func:`~arctic_platform.engine.losses.base.policy_tensors`) and ``A`` the advantages, per token:

* ``importance_sampling``: ``-r A``
* ``ppo``: ``-min(r A, clamp(r, lo, hi) A)``; ``lo``/``hi`` are ``processing.config``
  ``clip_low_threshold``/``clip_high_threshold`` (default 0.8 / 1.2)
* ``cispo``: ``-sg(clamp(r, lo, hi)) logp A`` (default thresholds 0.0 / 4.0)
* ``dro``: ``-(logp A - beta/2 (logp - old)^2)``; ``processing.config`` ``beta`` is required
  (Tinker documents no default)

The scored token at each position is ``labels`` where the batch has them (``-100`` elsewhere),
else ``input_ids``.

Tinker sums over tokens, so the default aggregation is ``token-sum``; ``processing.config``
``loss_agg_mode`` picks another (:mod:`.aggregation`). The log-ratio clamp, not in Tinker's
formulas, only guards ``exp`` against overflow. Metrics: ``loss``, ``actor/pg_loss``,
``actor/ppo_kl`` and, for ``ppo``/``cispo``, ``actor/pg_clipfrac`` (tokens whose ratio was clipped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from arctic_platform.contract.batch_layout import IGNORE_INDEX
from arctic_platform.contract.processing import RATIO_LOSSES
from arctic_platform.engine.batching import Batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.losses.aggregation import config_aggregation
from arctic_platform.engine.losses.base import (
    LossOutput,
    add_token_counts,
    masked,
    masked_sum,
    policy_ratio,
    policy_tensors,
    register_loss,
    token_mask,
)
from arctic_platform.engine.meta import Meta, to_float

_THRESHOLDS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}


class RatioLoss:
    """One of the Tinker policy losses bound to a request (see module doc)."""

    needs_entropy = False

    def __init__(self, kind: str, batch: Batch, meta: Meta, config: Mapping[str, Any]) -> None:
        self.kind = kind
        _, mask = token_mask(batch, kind)
        needed = policy_tensors(batch, config, kind)
        for name in needed:
            batch.check_finite(name, mask)
        self.tensors = {"mask": mask, **{name: batch.get(name) for name in needed}}
        self.reads = mask
        self.targets = None
        if batch.has("labels"):
            labels = batch.get("labels")
            self.targets = torch.where(labels != IGNORE_INDEX, labels, batch.input_ids)
        self.low, self.high = _thresholds(kind, config)
        self.beta = _beta(config) if kind == "dro" else 0.0
        self.agg = config_aggregation(config, "token-sum", meta=meta, batch=batch, mask=mask)

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        mask = rows["mask"]
        logp = outputs["logprobs"]
        adv, log_ratio, ratio = policy_ratio(logp, rows, mask)
        metrics = {}
        if self.kind == "importance_sampling":
            per_token = -ratio * adv
        elif self.kind == "dro":
            on_policy = "old_log_probs" not in rows
            old = logp.detach() if on_policy else masked(rows["old_log_probs"], mask)
            per_token = -(logp * adv - 0.5 * self.beta * (logp - old) ** 2)
        else:
            bounded = torch.clamp(ratio, self.low, self.high)
            metrics["actor/pg_clipfrac.sum"] = masked_sum((bounded != ratio).float(), mask)
            if self.kind == "ppo":
                per_token = -torch.minimum(ratio * adv, bounded * adv)
            else:
                per_token = -bounded.detach() * logp * adv
        metrics["loss.sum"] = masked_sum(per_token, mask)
        metrics["actor/pg_loss.sum"] = metrics["loss.sum"]
        metrics["actor/ppo_kl.sum"] = masked_sum(-log_ratio, mask)
        add_token_counts(metrics, mask.sum().float())
        return LossOutput(loss=self.agg(per_token, mask), metrics=metrics)


def _thresholds(kind: str, config: Mapping[str, Any]) -> tuple[float, float]:
    if kind not in _THRESHOLDS:
        return 0.0, 0.0
    default_low, default_high = _THRESHOLDS[kind]
    low = config.get("clip_low_threshold")
    high = config.get("clip_high_threshold")
    low = default_low if low is None else to_float("processing.config.clip_low_threshold", low)
    high = default_high if high is None else to_float("processing.config.clip_high_threshold", high)
    if not 0.0 <= low <= high:
        raise EngineInputError(
            "processing.config.clip_low_threshold",
            f"need 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}",
        )
    return low, high


def _beta(config: Mapping[str, Any]) -> float:
    if config.get("beta") is None:
        raise EngineInputError("processing.config.beta", "the dro loss needs beta (e.g. 0.05)")
    beta = to_float("processing.config.beta", config["beta"])
    if beta < 0:
        raise EngineInputError("processing.config.beta", f"must be >= 0, got {beta}")
    return beta


def _factory(kind: str):
    def build(batch: Batch, meta: Meta, config: Mapping[str, Any]) -> RatioLoss:
        return RatioLoss(kind, batch, meta, config)

    build.__name__ = f"{kind}_loss"
    build.__doc__ = f"Prepare the ``{kind}`` loss (see :mod:`{__name__}`)."
    return build


for _kind in RATIO_LOSSES:
    register_loss(_kind)(_factory(_kind))
