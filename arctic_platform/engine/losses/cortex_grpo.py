"""``grpo``: the Cortex GRPO contract (the reference's ``loss_fn: "grpo"``).

Knobs come from ``processing.config`` with the contract's defaults: ``eps_clip`` (0.2),
``eps_clip_higher`` (None: ``eps_clip``), ``c_clip`` (None: no dual clip), ``loss_agg_mode``
(``token-mean``), ``entropy_coeff`` (0), ``use_kl_loss`` (false), ``kl_loss_coef`` (0.001),
``kl_loss_type`` (``low_var_kl``). Per token, with ``old`` the behaviour log-probs
(``old_log_probs``; absent: the current log-probs, detached, so the ratio is 1)::

    r = exp(logp - old);  pg = max(-A r, -A clamp(r, 1 - eps_clip, 1 + eps_clip_higher))
    pg = min(pg, c_clip |A|)                      # with c_clip
    pg *= rollout_is_weights                      # when sent
    loss = agg(pg) + entropy_coeff * agg(logp.detach()) + kl_loss_coef * agg(kl(logp, ref))

The entropy term uses the sampled tokens' ``-logp`` (detached) as the reference does: it moves
the reported loss, not the gradient. The KL term needs ``ref_log_prob`` (the contract's
``ref_log_probs_shifted``).

**The global scale** (``dp_size``, ``batch_num_tokens``, ``global_batch_size``) resolves the way
the contract says: the value in the request's context (``meta``; ``dp_size`` is the server's
data-parallel width) wins over ``processing.config``, and a conflict between the two is an error.
``dp_size`` scales the loss only when a global denominator is known; otherwise each call is its
own mean.

Knobs of the reference's off-policy variants (SAPO, CISPO, M2PO, decoupled/proximal log-probs,
sequence-level ratios) are refused by name rather than ignored; so are ECHO's keys and masks,
which only ``grpo_echo_v1`` reads (:mod:`.cortex_grpo_echo`). Metrics are token
means over the loss mask: ``loss``, ``approx_kl``, ``importance_weight``, ``clip_ratio``,
``entropy`` (and ``kl_loss`` with KL).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from arctic_platform.contract.processing import GRPO
from arctic_platform.engine.batching import Batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.losses.aggregation import make_aggregation
from arctic_platform.engine.losses.base import (
    LossOutput,
    add_token_counts,
    clipped_surrogate,
    masked,
    masked_sum,
    register_loss,
    rollout_weighted,
    token_mask,
)
from arctic_platform.engine.losses.kl import check_kl_type, kl_penalty
from arctic_platform.engine.meta import Meta, option_reader, to_bool, to_float, to_int, to_str

FIELD = "processing.config"
# The contract's knobs that select variants this server does not implement, with the value that
# means "off"; any other value is refused.
UNSUPPORTED = {
    "behav_imp_weight_cap": None,
    "m2_threshold": None,
    "importance_sampling_level": "token",
    "current_version": None,
    "prox_logp_method": "recompute",
    "use_sapo_loss": False,
    "sapo_tau_pos": 1.0,
    "sapo_tau_neg": 1.05,
    "use_decoupled_loss": False,
    "use_cispo_loss": False,
    "is_weight_clip_max": None,
}
ECHO_KEYS = frozenset({"aux_ce_weight", "echo_global_num_sequences", "echo_batch_denominator"})
# ECHO's per-token masks (batch fields): the target tokens O' and the observation span O.
ECHO_MASKS = ("sft_mask", "echo_observation_mask")
SCALE_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size")
KNOWN_KEYS = frozenset(
    {
        "eps_clip",
        "eps_clip_higher",
        "c_clip",
        "loss_agg_mode",
        "entropy_coeff",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
        "calculate_entropy",
        *SCALE_KEYS,
        *UNSUPPORTED,
    }
)


@dataclass(frozen=True)
class GrpoConfig:
    """The contract's knobs (see module doc)."""

    eps_clip: float = 0.2
    eps_clip_higher: float = 0.2
    c_clip: float | None = None
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"


def parse_grpo_config(config: Mapping[str, Any]) -> GrpoConfig:
    """Type-check ``processing.config``; unknown keys and unsupported variants are errors."""
    echo = sorted(ECHO_KEYS & set(config))
    if echo:
        raise EngineInputError(
            f"{FIELD}.{echo[0]}", "an ECHO key: request loss grpo_echo_v1 for the ECHO objective"
        )
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise EngineInputError(
            f"{FIELD}.{unknown[0]}",
            f"unknown key for loss grpo; known: {', '.join(sorted(KNOWN_KEYS - set(UNSUPPORTED)))}",
        )
    for name, off in UNSUPPORTED.items():
        if config.get(name, off) != off:
            raise EngineInputError(
                f"{FIELD}.{name}", f"not supported by this server (only {off!r})"
            )

    get = option_reader(config, FIELD)

    eps = get("eps_clip", to_float, 0.2)
    parsed = GrpoConfig(
        eps_clip=eps,
        eps_clip_higher=get("eps_clip_higher", to_float, eps),
        c_clip=get("c_clip", to_float, None),
        loss_agg_mode=get("loss_agg_mode", to_str, "token-mean"),
        entropy_coeff=get("entropy_coeff", to_float, 0.0),
        use_kl_loss=get("use_kl_loss", to_bool, False),
        kl_loss_coef=get("kl_loss_coef", to_float, 0.001),
        kl_loss_type=check_kl_type(
            f"{FIELD}.kl_loss_type", get("kl_loss_type", to_str, "low_var_kl")
        ),
    )
    if parsed.eps_clip < 0 or parsed.eps_clip_higher < 0:
        raise EngineInputError(f"{FIELD}.eps_clip", "clip ranges must be >= 0")
    if parsed.c_clip is not None and not parsed.c_clip > 1.0:
        raise EngineInputError(f"{FIELD}.c_clip", f"must be > 1, got {parsed.c_clip}")
    return parsed


def resolve_scale(meta: Meta, config: Mapping[str, Any]) -> Meta:
    """``meta`` with the global scale resolved the contract's way: context wins, conflicts fail."""
    context = {
        "dp_size": meta.dp_size,
        "batch_num_tokens": meta.batch_num_tokens,
        "global_batch_size": meta.global_batch_size,
    }
    resolved = dict(context)
    for key in SCALE_KEYS:
        value = config.get(key)
        if value is None:
            continue
        value = (to_float if key == "batch_num_tokens" else to_int)(f"{FIELD}.{key}", value)
        ours = context[key]
        if ours is None:
            resolved[key] = value
        elif not math.isclose(float(ours), float(value), rel_tol=1e-6, abs_tol=1e-9):
            raise EngineInputError(
                f"{FIELD}.{key}",
                f"conflicting {key}: context={ours!r}, processing.config={value!r}",
            )
    if resolved["batch_num_tokens"] is None and resolved["global_batch_size"] is None:
        resolved["dp_size"] = 1  # no global denominator: each call is its own mean
    return replace(meta, **resolved)


class CortexGrpoLoss:
    """``grpo`` bound to one request (see module doc)."""

    targets = None
    needs_entropy = False

    def __init__(self, batch: Batch, meta: Meta, config: Mapping[str, Any]) -> None:
        self.cfg = parse_grpo_config(config)
        _, mask = token_mask(batch, "grpo")
        batch.require("advantages", "the grpo loss needs it (context.advantages)")
        needed = ["advantages"]
        for name in ("old_log_probs", "rollout_is_weights"):
            if batch.has(name):
                needed.append(name)
        if self.cfg.use_kl_loss:
            batch.require("ref_log_prob", "use_kl_loss is true (context.ref_log_probs_shifted)")
            needed.append("ref_log_prob")
        for name in needed:
            batch.check_finite(name, mask)
        self.tensors = {"mask": mask, **{name: batch.get(name) for name in needed}}
        self.reads = mask
        self.agg = make_aggregation(
            self.cfg.loss_agg_mode,
            field=f"{FIELD}.loss_agg_mode",
            meta=resolve_scale(meta, config),
            batch=batch,
            mask=mask,
        )

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        cfg = self.cfg
        mask = rows["mask"]
        logp = outputs["logprobs"]
        term = clipped_surrogate(logp, rows, mask, low=cfg.eps_clip, high=cfg.eps_clip_higher)
        pg = term.loss
        if cfg.c_clip is not None:
            pg = torch.minimum(pg, cfg.c_clip * term.advantages.abs())
        pg = rollout_weighted(pg, rows, mask)
        neg_entropy = logp.detach()
        loss = self.agg(pg, mask)
        per_token = pg
        if cfg.entropy_coeff != 0.0:
            loss = loss + cfg.entropy_coeff * self.agg(neg_entropy, mask)
            per_token = per_token + cfg.entropy_coeff * neg_entropy
        metrics = {
            "approx_kl.sum": masked_sum(term.log_ratio, mask),
            "importance_weight.sum": masked_sum(term.ratio, mask),
            "clip_ratio.sum": masked_sum((term.unclipped < term.clipped).float(), mask),
            "entropy.sum": masked_sum(-neg_entropy, mask),
        }
        if cfg.use_kl_loss:
            kld = kl_penalty(logp, masked(rows["ref_log_prob"], mask), cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * self.agg(kld, mask)
            per_token = per_token + cfg.kl_loss_coef * kld
            metrics["kl_loss.sum"] = masked_sum(kld, mask)
        metrics["loss.sum"] = masked_sum(per_token, mask)
        add_token_counts(metrics, mask.sum().float())
        return LossOutput(loss=loss, metrics=metrics)


def plain_grpo(batch: Batch, meta: Meta, config: Mapping[str, Any]) -> CortexGrpoLoss:
    """``grpo``: the ECHO masks are read only by ``grpo_echo_v1``, so here they are refused."""
    for name in ECHO_MASKS:
        if batch.has(name):
            raise EngineInputError(f"batch.{name}", "read only by loss grpo_echo_v1")
    return CortexGrpoLoss(batch, meta, config)


register_loss(GRPO)(plain_grpo)
