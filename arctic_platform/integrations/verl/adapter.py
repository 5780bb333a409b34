"""``ArcticRLClientWrapper``: arctic-platform as verl's ``RemoteBackend``.

One instance per verl process that needs the engines. The driver creates it with
``from_config(main_config)``: that reads ``remote_backend.arctic`` and verl's own keys
(:mod:`.verl_config`), creates the training, sampling and (when verl needs a reference policy)
log-prob jobs on the configured backend, and owns them. ``reconnect_handle()`` is what verl passes
to the forwarder worker and the rollout replica, which call ``from_config(main_config,
handle=...)`` to attach to the same jobs without owning them.

Besides the lifecycle of the ABC (``destroy``, ``update_weights``, ``save_checkpoint``), the
adapter turns verl batches into the wire layout of DESIGN.md §3 (:mod:`.batch_convert`) and runs
the ops: ``compute_log_prob`` (``fwd_no_grad``; position-indexed results, which the worker turns
into verl's order), ``train_mini_batch`` (``fwd_bwd`` with the ``verl_grpo`` loss, then ``step``)
and ``generate`` for the rollout replica. The loss knobs are verl's actor config, sent with every
update so the engines compute exactly verl's objective.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from tensordict import TensorDict

from arctic_platform.client import ArcticRLClient, ArcticRLError, create_arctic_rl_client
from arctic_platform.contract.processing import DEFAULT_POST as POST
from arctic_platform.engine.losses.verl_grpo import LOSS_NAME as LOSS_FN
from arctic_platform.integrations.verl.batch_convert import SequenceLayout, wire_batch
from arctic_platform.integrations.verl.compat import remote_backend_api
from arctic_platform.integrations.verl.verl_config import (
    ArcticSettings,
    check_verl_config,
    client_config,
    loss_knobs,
    read_settings,
)

log = logging.getLogger(__name__)

RemoteBackend = remote_backend_api().RemoteBackend

HANDLE_CONFIG = "rl_client_reconnect_config"
HANDLE_STATE = "rl_server_state"
# verl's weight-update modes that mean "the backend syncs its own sampler".
SYNC_MODES = ("auto", "naive", "remote_backend")


@dataclass(frozen=True)
class LogProbs:
    """``fwd_no_grad`` outputs of a verl batch, position-indexed ``[B, S]`` (DESIGN.md §3)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    layout: SequenceLayout
    metrics: dict[str, float] = field(default_factory=dict)


class ArcticRLClientWrapper(RemoteBackend):
    """The ``arctic`` remote backend (see the module doc)."""

    def __init__(
        self,
        main_config: DictConfig,
        settings: ArcticSettings,
        client: ArcticRLClient,
        *,
        owner: bool,
    ) -> None:
        self.settings = settings
        self.actor_config, self.policy_loss_config = loss_knobs(main_config)
        self.owner = owner
        self._client: ArcticRLClient | None = client

    # -- the RemoteBackend contract ---------------------------------------------------------

    @classmethod
    def from_config(
        cls, main_config: DictConfig, *, handle: dict[str, Any] | None = None
    ) -> ArcticRLClientWrapper:
        """Create the jobs (``handle=None``, the driver) or attach to the driver's (``handle``)."""
        settings = read_settings(main_config)
        if handle is None:
            check_verl_config(main_config)
            client = create_arctic_rl_client(client_config(main_config, settings))
            return cls(main_config, settings, client, owner=True)
        reconnect, state = _parse_handle(handle)
        return cls(main_config, settings, create_arctic_rl_client(reconnect, state), owner=False)

    def reconnect_handle(self) -> dict[str, Any]:
        """What another process passes to ``from_config(..., handle=)`` to attach to these jobs.

        The config part is plain data; the server state is ``None`` for the HTTP and Cortex
        backends, the registry actor's handle for Ray, and the in-process Service for
        ``inprocess`` (usable only inside this process).
        """
        client = self.client
        return {
            HANDLE_CONFIG: client.reconnect_config().model_dump(mode="json", by_alias=True),
            HANDLE_STATE: client.get_server_state(),
        }

    def requires_single_forwarder(self) -> bool:
        """One CPU forwarder drives the engines; their parallelism lives behind the backend."""
        return True

    def destroy(self) -> None:
        """Release the jobs (driver) or the connection (attached copies); idempotent.

        Synchronous, as ``RemoteBackend.destroy`` is: it returns when the jobs are released.
        """
        client, self._client = self._client, None
        if client is not None:
            client.shutdown()

    async def update_weights(self, mode: str = "auto") -> dict[str, Any]:
        """Copy the trainer's weights into the sampler (``mode``: verl's checkpoint-engine mode;
        the modes that mean "the backend syncs its sampler itself" are accepted)."""
        if mode not in SYNC_MODES:
            raise ValueError(
                f"mode: the arctic backend syncs its sampler itself and cannot serve weight-update "
                f"mode {mode!r}; set actor_rollout_ref.rollout.checkpoint_engine.backend to naive"
            )
        return await self.client.sync_weights()

    async def save_checkpoint(
        self, local_path: str | None = None, *, max_ckpt_to_keep: int | None = None
    ) -> dict[str, Any]:
        """Save weights, optimizer and schedule.

        With ``checkpoints: verl`` the checkpoint goes under ``local_path`` (verl's
        ``global_step_N/actor`` folder); with ``server`` (or without a path) into the server's
        own folder, where ``max_ckpt_to_keep`` bounds how many are kept. verl's folders hold one
        checkpoint each, so there verl's own retention applies.
        """
        path = self._checkpoint_path(local_path)
        limit = max_ckpt_to_keep if path is None else None
        if max_ckpt_to_keep is not None and path is not None:
            log.info("max_ckpt_to_keep=%s: verl prunes its own folders", max_ckpt_to_keep)
        return await self.client.save_checkpoint(path=path, save_total_limit=limit)

    # -- verl's resume path -----------------------------------------------------------------

    async def load_checkpoint(self, local_path: str | None = None) -> dict[str, Any]:
        """Restore the newest checkpoint under ``local_path`` (see :meth:`save_checkpoint`)."""
        return await self.client.load_checkpoint(path=self._checkpoint_path(local_path))

    # -- data path --------------------------------------------------------------------------

    async def compute_log_prob(
        self,
        data: TensorDict,
        *,
        reference: bool,
        calculate_entropy: bool,
        temperature: float,
        pad_token_id: int,
    ) -> LogProbs:
        """Log-probs (and entropies) of a verl batch under the policy or the reference model."""
        payload, layout = log_prob_payload(
            data,
            pad_token_id=pad_token_id,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
        )
        result = await self.client.fwd_no_grad(payload, reference_model=reference)
        outputs = result["batch"]
        entropy = None
        if calculate_entropy:
            if "entropy" not in outputs:
                raise ArcticRLError("fwd_no_grad: entropies were asked for but not returned")
            entropy = _tensor(outputs["entropy"])
        metrics = {k: float(v) for k, v in (result.get("metrics") or {}).items()}
        return LogProbs(_tensor(outputs["logprobs"]), entropy, layout, metrics)

    def mini_batch_payload(
        self,
        data: TensorDict,
        *,
        pad_token_id: int,
        temperature: float,
        calculate_entropy: bool,
    ) -> tuple[dict[str, Any], SequenceLayout]:
        """:func:`update_payload` with this run's loss knobs (checks the batch; sends nothing)."""
        return update_payload(
            data,
            actor_config=self.actor_config,
            policy_loss_config=self.policy_loss_config,
            pad_token_id=pad_token_id,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
        )

    async def train_mini_batch(self, payload: Mapping[str, Any]) -> dict[str, float]:
        """One optimizer update on a mini-batch envelope: ``fwd_bwd`` then ``step``.

        Returns the loss metrics under verl's names (``actor/pg_loss``, ``actor/pg_clipfrac``,
        ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, ``actor/entropy_loss``, ``kl_loss``,
        ``kl_coef``, ``loss``) plus ``grad_norm`` and ``lr`` (the rate this update used).
        """
        forward = await self.client.fwd_bwd(payload)
        step = await self.client.step()
        metrics = {name: float(value) for name, value in forward["metrics"].items()}
        metrics.setdefault("loss", float(forward["loss"]))
        metrics["grad_norm"] = float(step["grad_norm"])
        metrics["lr"] = float(step["last_lr"])
        return metrics

    async def generate(
        self, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """One completion of ``prompt_ids``: ``{token_ids, finish_reason, [logprobs], ...}``."""
        results = await self.client.generate(
            prompt_ids=[list(prompt_ids)], sampling_params=dict(sampling_params)
        )
        if len(results) != 1:
            raise ValueError(
                f"sampling_params.n: the rollout asks for one completion per call, got "
                f"{len(results)}"
            )
        return results[0]

    async def sleep_inference(self, level: int = 1) -> dict[str, Any]:
        return await self.client.sleep_inference(level)

    async def wake_inference(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return await self.client.wake_inference(tags)

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return await self.client.reset_prefix_cache()

    # -- helpers ----------------------------------------------------------------------------

    @property
    def client(self) -> ArcticRLClient:
        if self._client is None:
            raise ArcticRLError("this arctic backend was destroyed; create a new one")
        return self._client

    def _checkpoint_path(self, local_path: str | None) -> str | None:
        if local_path is None or self.settings.checkpoints == "server":
            return None
        return os.path.abspath(local_path)


def log_prob_payload(
    data: TensorDict, *, pad_token_id: int, temperature: float, calculate_entropy: bool
) -> tuple[dict[str, Any], SequenceLayout]:
    """The ``fwd_no_grad`` envelope of a verl batch, and its layout."""
    layout = SequenceLayout.of(data)
    meta = {
        "pad_token_id": pad_token_id,
        "temperature": float(temperature),
        "calculate_entropy": bool(calculate_entropy),
    }
    payload = {
        "batch": wire_batch(data, layout, pad_token_id=pad_token_id),
        "meta": meta,
        "processing": {"post": list(POST), "loss_fn": None},
    }
    return payload, layout


def update_payload(
    data: TensorDict,
    *,
    actor_config: Mapping[str, Any],
    policy_loss_config: Mapping[str, Any],
    pad_token_id: int,
    temperature: float,
    calculate_entropy: bool,
) -> tuple[dict[str, Any], SequenceLayout]:
    """The ``fwd_bwd`` envelope of one verl mini-batch, and its layout.

    ``meta`` carries verl's loss knobs (``actor_config``, ``policy_loss_config``: see
    :func:`.verl_config.loss_knobs`) and verl's global normalisers for this mini-batch:
    ``global_batch_size`` is its sequence count and ``batch_num_tokens`` its loss-token count (the
    engines add the data-parallel factor of their own workers).
    """
    layout = SequenceLayout.of(data)
    fields = ["response_mask", "advantages", "old_log_probs"]
    if actor_config.get("use_kl_loss"):
        fields.append("ref_log_prob")
    if "rollout_is_weights" in data:
        fields.append("rollout_is_weights")
    batch = wire_batch(data, layout, pad_token_id=pad_token_id, fields=tuple(fields))
    _check_finite(batch, [name for name in fields if name != "response_mask"])
    meta = {
        "pad_token_id": pad_token_id,
        "temperature": float(temperature),
        "calculate_entropy": bool(calculate_entropy),
        "global_batch_size": layout.rows,
        "batch_num_tokens": int(batch["response_mask"].sum()),
        "actor_config": dict(actor_config),
        "policy_loss_config": dict(policy_loss_config),
    }
    processing = {"post": list(POST), "loss_fn": LOSS_FN}
    return {"batch": batch, "meta": meta, "processing": processing}, layout


def _check_finite(batch: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
    """Per-token values must be finite on the tokens the loss uses (the engines would refuse the
    mini-batch anyway; refusing here keeps earlier mini-batches of the update from running)."""
    used = batch["response_mask"].bool()
    for name in names:
        bad = ~torch.isfinite(batch[name]) & used
        if bad.any():
            row, column = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"batch.{name}: NaN or infinity on a response token (row {row}, column {column})"
            )


def _parse_handle(handle: Any) -> tuple[Mapping[str, Any], Any]:
    if not isinstance(handle, Mapping):
        raise TypeError(
            f"handle: expected the dict reconnect_handle() returned, got {type(handle).__name__}"
        )
    config = handle.get(HANDLE_CONFIG)
    if not isinstance(config, Mapping):
        raise ValueError(
            f"handle[{HANDLE_CONFIG!r}]: missing or not a dict; pass what reconnect_handle() "
            "returned"
        )
    return config, handle.get(HANDLE_STATE)


def _tensor(value: Any) -> torch.Tensor:
    """A float32 CPU tensor of a wire output (torch, or numpy that may be read-only)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float()
    return torch.from_numpy(np.array(value, dtype=np.float32))
