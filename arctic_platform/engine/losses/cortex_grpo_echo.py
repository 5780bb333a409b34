"""``grpo_echo_v1``: the Cortex ``grpo`` contract plus ECHO's environment-prediction term.

ECHO (arXiv 2605.24517) trains a policy to also predict what its environment answers. The request
marks, per token, the observation span ``O`` (``echo_observation_mask``) and, inside it, the target
tokens ``O'`` (``sft_mask``), both in the context's shifted layout like ``loss_mask`` and moved to
the engine's position-indexed batch by ``server/cortex_context.py``. Per row ``s``::

    env_s = sum_{t in O'_s} -logp_t / max(|O_s|, 1)        # normalised by the whole span O
    loss  = grpo + aux_ce_weight * dp * sum_s env_s / echo_global_num_sequences

``grpo`` is :mod:`.cortex_grpo`'s objective with the same knobs; ``dp`` is the factor grpo's
aggregation applies (the resolved ``dp_size``), so the ratio of the two terms is the configured
``aux_ce_weight`` at any data-parallel width; ``echo_global_num_sequences`` is the client's count
of sequences in the whole optimizer step (no local fallback: a local count would rescale the term
with microbatch boundaries). ``aux_ce_weight: 0`` is the contract's control run: everything is
checked and the ECHO metrics reported, the term is not added.

The schema is strict, as the contract's: a key outside grpo's and ECHO's is an error, and
``aux_ce_weight`` and ``echo_global_num_sequences`` are required (not null). Also checked before
the pass: ``O'`` inside ``O``, both disjoint from ``loss_mask``, ``echo_batch_denominator`` one of
``all_sequences`` (rows with policy or observation tokens) and ``echo_bearing_sequences`` (rows with
observation tokens), and the global count not below that count in this request.

Metrics: grpo's, ``echo_environment_prediction_nll`` (a mean over ``O'``) and the contract's labels
``echo_contract_version``, ``echo_aux_ce_weight``, ``echo_dp_loss_multiplier``,
``echo_global_num_sequences`` and ``echo_batch_denominator_is_echo_bearing``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from arctic_platform.contract.processing import GRPO_ECHO
from arctic_platform.engine.batching import Batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.losses.base import LossOutput, masked, masked_sum, register_loss
from arctic_platform.engine.losses.cortex_grpo import (
    ECHO_KEYS,
    ECHO_MASKS,
    FIELD,
    KNOWN_KEYS,
    CortexGrpoLoss,
)
from arctic_platform.engine.meta import Meta

DENOMINATORS = ("all_sequences", "echo_bearing_sequences")
REQUIRED = ("aux_ce_weight", "echo_global_num_sequences")


@dataclass(frozen=True)
class EchoConfig:
    """ECHO's knobs (see module doc)."""

    aux_ce_weight: float
    global_num_sequences: int
    denominator: str


def parse_echo_config(config: Mapping[str, Any]) -> tuple[EchoConfig, dict[str, Any]]:
    """``(ECHO knobs, grpo's config)`` from ``processing.config``, under the strict schema."""
    unknown = sorted(set(config) - KNOWN_KEYS - ECHO_KEYS)
    if unknown:
        raise EngineInputError(
            f"{FIELD}.{unknown[0]}", "unknown key for loss grpo_echo_v1, whose schema is strict"
        )
    for key in REQUIRED:
        if config.get(key) is None:
            raise EngineInputError(
                f"{FIELD}.{key}", "required by loss grpo_echo_v1 (grpo trains without ECHO)"
            )
    weight = config["aux_ce_weight"]
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or weight < 0
    ):
        raise EngineInputError(f"{FIELD}.aux_ce_weight", f"a finite number >= 0, got {weight!r}")
    count = config["echo_global_num_sequences"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise EngineInputError(
            f"{FIELD}.echo_global_num_sequences", f"a sequence count >= 1, got {count!r}"
        )
    denominator = config.get("echo_batch_denominator", DENOMINATORS[0])
    if denominator not in DENOMINATORS:
        raise EngineInputError(
            f"{FIELD}.echo_batch_denominator", f"one of {', '.join(DENOMINATORS)}"
        )
    grpo = {k: v for k, v in config.items() if k not in ECHO_KEYS}
    return EchoConfig(float(weight), count, denominator), grpo


class CortexGrpoEchoLoss:
    """``grpo_echo_v1`` bound to one request (see module doc)."""

    targets = None
    needs_entropy = False

    def __init__(self, batch: Batch, meta: Meta, config: Mapping[str, Any]) -> None:
        self.echo, grpo_config = parse_echo_config(config)
        self.policy = CortexGrpoLoss(batch, meta, grpo_config)
        policy = self.policy.tensors["mask"]
        sft_name, obs_name = ECHO_MASKS
        sft = batch.require(sft_name, "loss grpo_echo_v1 needs it (context.sft_mask)")
        obs = batch.require(obs_name, "loss grpo_echo_v1 needs it (context.echo_observation_mask)")
        batch.check_loss_mask(sft_name, sft)  # every target token must have a log-prob
        for name, bad, why in (
            (sft_name, sft & ~obs, "must lie inside echo_observation_mask (O' within O)"),
            (sft_name, sft & policy, "overlaps loss_mask: a token belongs to one objective"),
            (obs_name, obs & policy, "overlaps loss_mask: observations are not policy targets"),
        ):
            if bad.any():
                raise EngineInputError(
                    f"batch.{name}", f"{why} (row {int(bad.any(1).nonzero()[0, 0])})"
                )
        bearing = obs.any(1)
        local = int(
            (bearing | policy.any(1)).sum()
            if self.echo.denominator == DENOMINATORS[0]
            else bearing.sum()
        )
        if self.echo.global_num_sequences < local:
            raise EngineInputError(
                f"{FIELD}.echo_global_num_sequences",
                f"{self.echo.global_num_sequences} is below this request's "
                f"{self.echo.denominator} count ({local})",
            )
        self.dp = self.policy.agg.dp_size
        self.tensors = {**self.policy.tensors, "sft_mask": sft, "observation_mask": obs}
        self.reads = self.policy.reads | sft

    def __call__(
        self, outputs: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]
    ) -> LossOutput:
        echo = self.echo
        out = self.policy(outputs, rows)
        logp = outputs["logprobs"]
        sft = rows["sft_mask"]
        span = rows["observation_mask"].sum(1).clamp(min=1).to(logp.dtype)
        env = (masked(-logp, sft).sum(1) / span).sum() / echo.global_num_sequences * self.dp
        loss = out.loss + echo.aux_ce_weight * env if echo.aux_ce_weight > 0 else out.loss
        metrics = {
            **out.metrics,
            "echo_environment_prediction_nll.sum": masked_sum(-logp, sft),
            "echo_environment_prediction_nll.tokens": sft.sum().float(),
            "echo_contract_version": 1.0,
            "echo_aux_ce_weight": echo.aux_ce_weight,
            "echo_dp_loss_multiplier": float(self.dp),
            "echo_global_num_sequences": float(echo.global_num_sequences),
            "echo_batch_denominator_is_echo_bearing": float(echo.denominator == DENOMINATORS[1]),
        }
        return LossOutput(loss=loss, metrics=metrics)


register_loss(GRPO_ECHO)(CortexGrpoEchoLoss)
