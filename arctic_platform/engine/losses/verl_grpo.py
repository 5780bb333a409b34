"""``verl_grpo``: verl's PPO-clip actor loss, with every knob read from ``meta.actor_config``.

Per token, with ``d = clamp(logp - old, -20, 20)`` and ``r = exp(d)`` (``old``: the batch's
``old_log_probs``, or the current log-probs detached in the on-policy form, see
:func:`~arctic_platform.engine.losses.base.policy_tensors`)::

    L1 = -A r;  L2 = -A clamp(r, 1 - eps_low, 1 + eps_high);  Lc = max(L1, L2)
    L3 = -A c;  pg = where(A < 0, min(L3, Lc), Lc)       # dual clip for negative advantages
    pg *= rollout_is_weights                                # when sent

    loss = agg(pg) - entropy_coeff * agg(H) + kl_loss_coef * agg(kl(logp, ref))

``agg`` is ``loss_agg_mode`` (:mod:`.aggregation`); the entropy term applies whenever entropies were
computed (they are when ``entropy_coeff != 0`` or when asked for), the KL term when
``use_kl_loss``. Unlike the reference server, which hard-codes ``eps = 0.2`` and ``c = 3``, the
configured ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` and ``clip_ratio_c`` are used.

Metrics are global token means over the loss mask: ``actor/pg_loss``, ``actor/pg_clipfrac``
(``L2 > L1``), ``actor/ppo_kl`` (``-d``), ``actor/pg_clipfrac_lower`` (``Lc > L3`` with ``A < 0``),
``actor/entropy_loss`` (``H``), ``kl_loss``, ``kl_coef`` and ``loss`` (the per-token total
``pg - entropy_coeff H + kl_loss_coef kl``; equal to the objective under ``token-mean``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from arctic_platform.contract.processing import VERL_GRPO
from arctic_platform.engine.batching import Batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.losses.aggregation import check_agg_mode, make_aggregation
from arctic_platform.engine.losses.base import (
    LossOutput,
    add_token_counts,
    clipped_surrogate,
    masked,
    masked_sum,
    policy_tensors,
    register_loss,
    rollout_weighted,
    token_mask,
)
from arctic_platform.engine.losses.kl import check_kl_type, kl_penalty
from arctic_platform.engine.meta import Meta, option_reader, to_bool, to_float, to_str


@dataclass(frozen=True)
class ActorLossConfig:
    """The loss knobs of verl's actor config, with verl's defaults."""

    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"


def parse_actor_config(
    actor_config: Mapping[str, Any], policy_loss_config: Mapping[str, Any] | None = None
) -> ActorLossConfig:
    """Type-check the known keys (a None value means verl's default); other keys are ignored.

    verl sends its whole actor config (optimizer, batch sizes, ...) and turns values it cannot
    serialise into None, so unknown keys and Nones are expected. ``clip_ratio_low``/``_high``
    default to ``clip_ratio``. Only the ``vanilla`` policy loss mode is implemented; another mode
    is an error rather than a silent substitution.
    """
    field = "meta.actor_config"

    get = option_reader(actor_config, field)

    clip = get("clip_ratio", to_float, 0.2)
    parsed = ActorLossConfig(
        clip_ratio=clip,
        clip_ratio_low=get("clip_ratio_low", to_float, clip),
        clip_ratio_high=get("clip_ratio_high", to_float, clip),
        clip_ratio_c=get("clip_ratio_c", to_float, 3.0),
        loss_agg_mode=check_agg_mode(
            f"{field}.loss_agg_mode", get("loss_agg_mode", to_str, "token-mean")
        ),
        loss_scale_factor=get("loss_scale_factor", to_float, None),
        entropy_coeff=get("entropy_coeff", to_float, 0.0),
        use_kl_loss=get("use_kl_loss", to_bool, False),
        kl_loss_coef=get("kl_loss_coef", to_float, 0.001),
        kl_loss_type=check_kl_type(
            f"{field}.kl_loss_type", get("kl_loss_type", to_str, "low_var_kl")
        ),
    )
    for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        if getattr(parsed, name) < 0:
            raise EngineInputError(f"{field}.{name}", f"must be >= 0, got {getattr(parsed, name)}")
    if not parsed.clip_ratio_c > 1.0:
        raise EngineInputError(
            f"{field}.clip_ratio_c", f"must be > 1 (dual-clip bound), got {parsed.clip_ratio_c}"
        )
    _check_loss_mode(actor_config, policy_loss_config or {})
    return parsed


def _check_loss_mode(actor_config: Mapping[str, Any], policy_loss_config: Mapping[str, Any]):
    nested = actor_config.get("policy_loss")
    sources = [("meta.policy_loss_config.loss_mode", policy_loss_config.get("loss_mode"))]
    if isinstance(nested, Mapping):
        sources.append(("meta.actor_config.policy_loss.loss_mode", nested.get("loss_mode")))
    for field, mode in sources:
        if mode is not None and mode != "vanilla":
            raise EngineInputError(
                field, f"policy loss mode {mode!r} is not implemented by verl_grpo (only vanilla)"
            )


class VerlGrpoLoss:
    """``verl_grpo`` bound to one request (see module doc)."""

    targets = None

    def __init__(self, batch: Batch, meta: Meta, config: Mapping[str, Any]) -> None:
        self.cfg = parse_actor_config(meta.actor_config, meta.policy_loss_config)
        _, mask = token_mask(batch, "verl_grpo")
        needed = policy_tensors(batch, config, "verl_grpo")
        if self.cfg.use_kl_loss:
            batch.require("ref_log_prob", "meta.actor_config.use_kl_loss is true")
            needed.append("ref_log_prob")
        if batch.has("rollout_is_weights"):
            needed.append("rollout_is_weights")
        for name in needed:
            batch.check_finite(name, mask)
        self.tensors = {"mask": mask, **{name: batch.get(name) for name in needed}}
        self.reads = mask
        self.needs_entropy = self.cfg.entropy_coeff != 0.0
        self.agg = make_aggregation(
            self.cfg.loss_agg_mode,
            field="meta.actor_config.loss_agg_mode",
            meta=meta,
            batch=batch,
            mask=mask,
            scale_factor=self.cfg.loss_scale_factor,
        )

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        cfg = self.cfg
        mask = rows["mask"]
        logp = outputs["logprobs"]
        term = clipped_surrogate(logp, rows, mask, low=cfg.clip_ratio_low, high=cfg.clip_ratio_high)
        loss3 = -term.advantages * cfg.clip_ratio_c  # dual clip, for negative advantages
        negative = term.advantages < 0
        pg = torch.where(negative, torch.minimum(loss3, term.loss), term.loss)
        pg = rollout_weighted(pg, rows, mask)

        metrics = {
            "actor/pg_loss.sum": masked_sum(pg, mask),
            "actor/pg_clipfrac.sum": masked_sum((term.clipped > term.unclipped).float(), mask),
            "actor/ppo_kl.sum": masked_sum(-term.log_ratio, mask),
            "actor/pg_clipfrac_lower.sum": masked_sum(
                ((term.loss > loss3) & negative).float(), mask
            ),
        }
        loss = self.agg(pg, mask)
        per_token = pg
        if "entropy" in outputs:
            entropy = outputs["entropy"]
            loss = loss - cfg.entropy_coeff * self.agg(entropy, mask)
            per_token = per_token - cfg.entropy_coeff * entropy
            metrics["actor/entropy_loss.sum"] = masked_sum(entropy, mask)
        if cfg.use_kl_loss:
            kld = kl_penalty(logp, masked(rows["ref_log_prob"], mask), cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * self.agg(kld, mask)
            per_token = per_token + cfg.kl_loss_coef * kld
            metrics["kl_loss.sum"] = masked_sum(kld, mask)
            metrics["kl_coef"] = cfg.kl_loss_coef
        metrics["loss.sum"] = masked_sum(per_token, mask)
        add_token_counts(metrics, mask.sum().float())
        return LossOutput(loss=loss, metrics=metrics)


LOSS_NAME = VERL_GRPO
register_loss(LOSS_NAME)(VerlGrpoLoss)
