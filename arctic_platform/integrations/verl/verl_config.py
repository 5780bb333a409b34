"""Read verl's Hydra config: the ``remote_backend.arctic`` settings and the client config they give.

verl hands every plugin its whole config (``main_config``). The arctic section
(``config/remote_backend/arctic.yaml`` documents every key) says where the engines run and how big
the jobs are; the rest comes from verl's own keys, so a verl user configures the model, the
optimizer, the schedule and the sequence lengths where they always have:

* model: ``actor_rollout_ref.model.path`` (LoRA from ``model.lora_rank``/``lora_alpha``/
  ``target_modules``, gradient checkpointing from ``model.enable_gradient_checkpointing``);
* optimizer: ``actor_rollout_ref.actor.optim`` (AdamW ``lr``, ``betas``, ``weight_decay``,
  ``clip_grad``);
* schedule: verl steps its scheduler once per training step, our engine once per optimizer update
  (one per mini-batch and epoch), so warmup and horizon are verl's step counts times the updates
  per step (``ppo_epochs * train_batch_size // ppo_mini_batch_size``);
* lengths: ``data.max_prompt_length + data.max_response_length``.

Errors name the verl key to fix (``ValueError``), before any job is created.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from arctic_platform.client.config import (
    ArcticRLClientConfig,
    CortexBackend,
    HttpBackend,
    InProcessBackend,
    RayBackend,
)
from arctic_platform.engine.config import PromptSharing

SECTION = "remote_backend.arctic"
ROLLOUT_NAME = "arctic"
BACKENDS = {
    "inprocess": InProcessBackend,
    "http": HttpBackend,
    "ray": RayBackend,
    "cortex": CortexBackend,
}
SEARCH_PATH = "pkg://arctic_platform.integrations.verl.config"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainingSection(_Strict):
    n_gpus: PositiveInt = 1
    max_tokens_per_microbatch: PositiveInt | None = None
    packing: bool = True
    prompt_sharing: PromptSharing = "auto"
    attn_implementation: str | None = None


class SamplingSection(_Strict):
    n_gpus: PositiveInt = 1
    max_batch_size: PositiveInt | None = None
    max_seq_len: PositiveInt | None = None


class LogProbSection(_Strict):
    enable: Literal["auto"] | bool = "auto"
    n_gpus: PositiveInt = 1
    max_tokens_per_microbatch: PositiveInt | None = None
    prompt_sharing: PromptSharing = "auto"


class ArcticSettings(_Strict):
    """The ``remote_backend.arctic`` section, typed (keys and meanings: ``arctic.yaml``)."""

    backend: Literal["inprocess", "http", "ray", "cortex"] | None = "http"
    inprocess: dict[str, Any] = Field(default_factory=dict)
    http: dict[str, Any] = Field(default_factory=dict)
    ray: dict[str, Any] = Field(default_factory=dict)
    cortex: dict[str, Any] = Field(default_factory=dict)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 42
    pad_token_id: int | None = Field(None, ge=0)
    training: TrainingSection = TrainingSection()
    sampling: SamplingSection = SamplingSection()
    log_prob: LogProbSection = LogProbSection()
    checkpoints: Literal["verl", "server"] = "verl"
    device_peak_tflops: PositiveFloat = 989.0

    @field_validator("inprocess", "http", "ray", "cortex", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value


def read_settings(main_config: DictConfig | Mapping) -> ArcticSettings:
    """The typed ``remote_backend.arctic`` section of ``main_config``."""
    section = OmegaConf.select(_as_config(main_config), SECTION, default=None)
    if section is None:
        raise ValueError(
            f"{SECTION}: missing; choose the arctic backend with the Hydra group "
            f"`remote_backend=arctic` (`+remote_backend=arctic` on a verl without the group) and "
            f"hydra.searchpath=[{SEARCH_PATH}]"
        )
    data = _plain(section)
    try:
        return ArcticSettings.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_describe(exc, SECTION)) from None


def check_verl_config(main_config: DictConfig) -> None:
    """Refuse verl settings the arctic backend cannot honour, naming the key (before any job)."""
    rollout = main_config.actor_rollout_ref.rollout
    if rollout.name != ROLLOUT_NAME:
        raise ValueError(
            f"actor_rollout_ref.rollout.name: is {rollout.name!r}; the arctic backend serves "
            f"generation itself, set it to {ROLLOUT_NAME!r}"
        )
    width = (
        rollout.tensor_model_parallel_size
        * rollout.data_parallel_size
        * rollout.pipeline_model_parallel_size
    )
    if width != 1:
        raise ValueError(
            "actor_rollout_ref.rollout.tensor_model_parallel_size: the arctic rollout is one "
            "replica behind one forwarder, so tensor/data/pipeline parallel sizes must be 1 (got "
            f"{width} in all); the sampling job's devices are {SECTION}.sampling.n_gpus"
        )
    sync = OmegaConf.select(rollout, "checkpoint_engine.backend", default="naive")
    if sync not in ("naive", "remote_backend"):
        raise ValueError(
            f"actor_rollout_ref.rollout.checkpoint_engine.backend: {sync!r}; the arctic backend "
            "syncs its sampler itself, use naive"
        )
    forwarders = int(main_config.trainer.n_gpus_per_node) * int(main_config.trainer.nnodes)
    if forwarders != 1:
        raise ValueError(
            f"trainer.n_gpus_per_node: verl runs one forwarder for the arctic backend, so "
            f"n_gpus_per_node x nnodes must be 1 (got {forwarders}); the engines' devices are "
            f"{SECTION}.training.n_gpus and {SECTION}.sampling.n_gpus"
        )
    actor = main_config.actor_rollout_ref.actor
    mode = OmegaConf.select(actor, "policy_loss.loss_mode", default="vanilla")
    if mode != "vanilla":
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode: {mode!r} is not implemented by the "
            "arctic backend's verl_grpo loss (only vanilla)"
        )
    optimizer = OmegaConf.select(actor, "optim.optimizer", default="AdamW")
    if str(optimizer).lower() != "adamw":
        raise ValueError(
            f"actor_rollout_ref.actor.optim.optimizer: {optimizer!r}; the arctic engines train "
            "with AdamW"
        )
    if _distillation_enabled(main_config):
        raise ValueError("distillation.enabled: not supported by the arctic backend")


def client_config(main_config: DictConfig, settings: ArcticSettings) -> ArcticRLClientConfig:
    """The ``ArcticRLClientConfig`` of a verl run: jobs sized and tuned from verl's keys."""
    ref = main_config.actor_rollout_ref
    actor = ref.actor
    lengths = main_config.data
    max_seq_len = int(lengths.max_prompt_length) + int(lengths.max_response_length)
    data: dict[str, Any] = {
        "model": str(ref.model.path),
        "dtype": settings.dtype,
        "seed": settings.seed,
        "experiment_name": OmegaConf.select(main_config, "trainer.experiment_name"),
        "training": _training_job(main_config, settings, max_seq_len),
        "sampling": {
            "n_gpus": settings.sampling.n_gpus,
            "max_seq_len": sampling_max_seq_len(main_config, settings),
            "max_batch_size": settings.sampling.max_batch_size or int(ref.rollout.max_num_seqs),
        },
    }
    if _wants_reference(main_config, settings):
        data["log_prob"] = {
            "n_gpus": settings.log_prob.n_gpus,
            "max_seq_len": max_seq_len,
            "max_tokens_per_microbatch": settings.log_prob.max_tokens_per_microbatch
            or OmegaConf.select(ref, "ref.log_prob_max_token_len_per_gpu")
            or int(actor.ppo_max_token_len_per_gpu),
            "prompt_sharing": settings.log_prob.prompt_sharing,
        }
    if settings.backend is not None:
        data["backend"] = _backend(settings)
    try:
        return ArcticRLClientConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_describe(exc, "the arctic client config")) from None


def sampling_max_seq_len(main_config: DictConfig, settings: ArcticSettings) -> int:
    """The sampler's prompt-plus-completion limit: the arctic setting, else verl's
    ``rollout.max_model_len``, else the prompt and response lengths of verl's data section."""
    data = main_config.data
    return int(
        settings.sampling.max_seq_len
        or main_config.actor_rollout_ref.rollout.get("max_model_len")
        or int(data.max_prompt_length) + int(data.max_response_length)
    )


def _backend(settings: ArcticSettings) -> Any:
    """The chosen backend's section, validated by the client's own model (errors name the key)."""
    kind = settings.backend
    try:
        return BACKENDS[kind].model_validate(getattr(settings, kind))
    except ValidationError as exc:
        raise ValueError(_describe(exc, f"{SECTION}.{kind}")) from None


def updates_per_step(main_config: DictConfig) -> int:
    """Optimizer updates per verl training step: ``ppo_epochs`` times the mini-batches."""
    actor = main_config.actor_rollout_ref.actor
    batch, mini = int(main_config.data.train_batch_size), int(actor.ppo_mini_batch_size)
    if mini <= 0 or batch % mini:
        raise ValueError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size: {mini} must divide "
            f"data.train_batch_size ({batch})"
        )
    epochs = int(actor.ppo_epochs)
    if epochs < 1:
        raise ValueError(f"actor_rollout_ref.actor.ppo_epochs: must be >= 1, got {epochs}")
    return epochs * (batch // mini)


def loss_knobs(main_config: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """``meta.actor_config`` and ``meta.policy_loss_config``: the loss knobs of verl's actor."""
    actor = main_config.actor_rollout_ref.actor
    names = (
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "loss_agg_mode",
        "loss_scale_factor",
        "entropy_coeff",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
    )
    knobs = {name: _plain(actor.get(name)) for name in names}
    mode = OmegaConf.select(actor, "policy_loss.loss_mode", default="vanilla")
    return knobs, {"loss_mode": mode}


def _training_job(main_config: DictConfig, settings: ArcticSettings, max_seq_len: int) -> dict:
    ref = main_config.actor_rollout_ref
    actor, model = ref.actor, ref.model
    optim = actor.optim
    clip = optim.get("clip_grad")
    job: dict[str, Any] = {
        "n_gpus": settings.training.n_gpus,
        "max_seq_len": max_seq_len,
        "train_batch_size": int(actor.ppo_mini_batch_size) * int(ref.rollout.n),
        "optimizer": {
            "lr": float(optim.lr),
            "betas": list(optim.get("betas") or (0.9, 0.999)),
            "weight_decay": float(optim.get("weight_decay") or 0.0),
            "grad_clip": float(clip if clip is not None else actor.get("grad_clip", 1.0)),
        },
        "schedule": _schedule(main_config),
        "max_tokens_per_microbatch": settings.training.max_tokens_per_microbatch
        or int(actor.ppo_max_token_len_per_gpu),
        "packing": settings.training.packing,
        "prompt_sharing": settings.training.prompt_sharing,
        "gradient_checkpointing": bool(model.get("enable_gradient_checkpointing", False)),
        "attn_implementation": settings.training.attn_implementation,
    }
    rank = int(model.get("lora_rank") or 0)
    if rank > 0:
        if model.get("exclude_modules"):
            raise ValueError(
                "actor_rollout_ref.model.exclude_modules: not supported by the arctic backend's "
                "LoRA; list the modules to adapt in target_modules instead"
            )
        targets = _plain(model.get("target_modules", "all-linear"))
        job["lora"] = {"r": rank, "alpha": float(model.lora_alpha), "target_modules": targets}
    return job


def _schedule(main_config: DictConfig) -> dict[str, Any]:
    """verl's LR schedule in optimizer updates (see the module doc)."""
    optim = main_config.actor_rollout_ref.actor.optim
    name = optim.get("lr_scheduler_type") or optim.get("warmup_style") or "constant"
    if name not in ("constant", "cosine"):
        raise ValueError(
            f"actor_rollout_ref.actor.optim.lr_scheduler_type: {name!r}; the arctic backend runs "
            "constant or cosine"
        )
    if name == "cosine" and float(optim.get("num_cycles", 0.5)) != 0.5:
        raise ValueError(
            "actor_rollout_ref.actor.optim.num_cycles: only 0.5 (a half cosine) is supported"
        )
    per_step = updates_per_step(main_config)
    total = _total_training_steps(main_config)
    warmup = int(optim.get("lr_warmup_steps") or -1)
    ratio = float(optim.get("lr_warmup_steps_ratio") or 0.0)
    if warmup <= 0 and ratio > 0:
        if total is None:
            raise _needs_total("lr_warmup_steps_ratio")
        warmup = round(ratio * total)
    schedule: dict[str, Any] = {
        "name": name,
        "warmup_steps": max(warmup, 0) * per_step,
        "min_lr_ratio": float(optim.get("min_lr_ratio") or 0.0),
    }
    if name == "cosine":
        if total is None:
            raise _needs_total("lr_scheduler_type=cosine")
        schedule["total_steps"] = total * per_step
    return schedule


def _total_training_steps(main_config: DictConfig) -> int | None:
    """verl's step count: ``actor.optim.total_training_steps`` (filled by verl's trainer), else
    ``trainer.total_training_steps``; None when neither is known yet."""
    for key in (
        "actor_rollout_ref.actor.optim.total_training_steps",
        "trainer.total_training_steps",
    ):
        value = OmegaConf.select(main_config, key, default=None)
        if value is not None and int(value) > 0:
            return int(value)
    return None


def _needs_total(what: str) -> ValueError:
    return ValueError(
        f"trainer.total_training_steps: {what} needs the number of training steps; set it (verl's "
        "remote-backend trainer creates the backend before it counts the dataloader's steps)"
    )


def _wants_reference(main_config: DictConfig, settings: ArcticSettings) -> bool:
    if settings.log_prob.enable != "auto":
        return bool(settings.log_prob.enable)
    use_kl_in_reward = bool(OmegaConf.select(main_config, "algorithm.use_kl_in_reward") or False)
    return use_kl_in_reward or bool(main_config.actor_rollout_ref.actor.use_kl_loss)


def _distillation_enabled(main_config: DictConfig) -> bool:
    return bool(OmegaConf.select(main_config, "distillation.enabled", default=False))


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _as_config(main_config: DictConfig | Mapping) -> DictConfig:
    return main_config if isinstance(main_config, DictConfig) else OmegaConf.create(main_config)


def _describe(exc: ValidationError, where: str) -> str:
    """One line per problem, each naming its dotted key under ``where``."""
    problems = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"])
        problems.append(f"{where}.{key}: {error['msg']}" if key else f"{where}: {error['msg']}")
    return "; ".join(problems)
