"""What a client sends to create a job: the one job-config schema every edge validates.

One shape serves every backend: the Cortex/SnowAPI ``SubJobConfig`` (job type, model, a
``training_config`` or an ``inference_config``, dtype, seed, optional source checkpoint). Its
settings are composed from the engine settings of :mod:`arctic_platform.contract.settings`
(optimizer, schedule, LoRA: one definition, one default, their validators), and the client's YAML
config composes these sections in turn (:mod:`arctic_platform.client.config`). The in-process
transport, the on-prem ``/initialize`` route and the Cortex create-job route all validate this
model, so a bad value fails the same way everywhere, naming the field, before any job exists.
Keys that Cortex defines for its own GPU stack (DeepSpeed configs, expert parallelism, ...) are
accepted and recorded as ignored, so clients written for Cortex keep working.

Only pydantic is needed: the client builds these objects without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    AliasChoices,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from arctic_platform.contract.ops import Role
from arctic_platform.contract.settings import (
    LogitsSettings,
    LoraConfig,
    OptimizerConfig,
    PromptSharing,
    SamplingEngineName,
    SchedulerConfig,
    Seed,
    Settings,
    VllmSettings,
)

# Sub-job types: this project's short names (the op table's roles, used in sub-job ids) and the
# Cortex API's, with the one map between them each way.
JobType = Role
ApiJobType = Literal["training", "sampling", "log_probability"]
API_JOB_TYPE: dict[str, ApiJobType] = {
    "training": "training",
    "sampling": "sampling",
    "log_prob": "log_probability",
}
# Either spelling -> ours (derived from API_JOB_TYPE: the one name map).
SHORT_JOB_TYPE: dict[str, JobType] = {
    **{short: short for short in API_JOB_TYPE},
    **{api: short for short, api in API_JOB_TYPE.items()},
}

# Cortex keys for its own GPU stack; accepted so Cortex clients work, recorded as ignored.
CORTEX_TRAINING_PASSTHROUGH = frozenset(
    {
        "model_provider",
        "ep_size",
        "sp_size",
        "ds_config",
        "prime_rl",
        "router_replay",
        "cuda_allocator_conf",
        "ac_config",
        "step_peak_memory_log",
        "training_memory_telemetry",
        "multiplex_job_id",
    }
)
# An inference sub-job's peft_config is passthrough too: samplers hold merged weights, and a LoRA
# trainer's adapters reach them merged through weight sync.
CORTEX_INFERENCE_PASSTHROUGH = frozenset(
    {"gpu_memory_utilization", "multiplex_job_id", "peft_config"}
)
# vLLM engine arguments that mean something on our sampler; the rest are recorded as ignored.
VLLM_KEYS_USED = frozenset(
    {"max_num_seqs", "max_model_len", "enable_prefix_caching", "kv_cache_memory_bytes"}
)


_Spec = Settings


class _WithPassthrough(_Spec):
    """Accepts a fixed set of foreign keys and remembers them instead of failing."""

    ignored: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _collect_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            foreign = {k: data[k] for k in data if k in cls.passthrough_keys}
            if foreign:
                data = {k: v for k, v in data.items() if k not in cls.passthrough_keys}
                data["ignored"] = {**data.get("ignored", {}), **foreign}
        return data


def _cortex_name(name: str, cortex: str) -> dict[str, Any]:
    """Field options for a setting the Cortex API names ``cortex``: both names are accepted, the
    Cortex one is written."""
    return {"validation_alias": AliasChoices(name, cortex), "serialization_alias": cortex}


class TrainingSettings(_WithPassthrough):
    """``training_config`` of a training sub-job (the client's ``training:`` section adds the
    model and seed to it).

    Field names are this project's; the Cortex API's names are accepted and written on the wire:
    ``lr_scheduler`` (``schedule``), ``activation_checkpointing`` (``gradient_checkpointing``),
    ``peft_config`` (``lora``) and a top-level ``gradient_clipping`` (``optimizer.grad_clip``).
    ``data_parallel`` None means the server's default (ddp).
    """

    passthrough_keys: ClassVar[frozenset[str]] = CORTEX_TRAINING_PASSTHROUGH

    n_gpus: PositiveInt = 1
    max_seq_len: PositiveInt = 4096
    train_batch_size: PositiveInt | None = None
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: SchedulerConfig = Field(SchedulerConfig(), **_cortex_name("schedule", "lr_scheduler"))
    max_tokens_per_microbatch: PositiveInt = 16384
    packing: bool = True
    prompt_sharing: PromptSharing = "auto"
    logits: LogitsSettings = LogitsSettings()
    gradient_checkpointing: bool = Field(
        False, **_cortex_name("gradient_checkpointing", "activation_checkpointing")
    )
    attn_implementation: str | None = None
    lora: LoraConfig | None = Field(None, **_cortex_name("lora", "peft_config"))
    save_total_limit: PositiveInt | None = None
    load_optimizer_states: bool = True
    data_parallel: Literal["ddp", "fsdp"] | None = None
    # The root a save or load without ``path`` uses (the job's own folder is made inside it);
    # None: the server's checkpoint folder of the job's owner. The server checks it is writable.
    checkpoint_dir: str | None = Field(None, min_length=1)

    @classmethod
    def known_keys(cls) -> set[str]:
        return super().known_keys() | {"gradient_clipping"}

    @model_validator(mode="before")
    @classmethod
    def _fold_gradient_clipping(cls, data: Any) -> Any:
        """Cortex's top-level ``gradient_clipping`` is ``optimizer.grad_clip`` here."""
        if isinstance(data, dict) and "gradient_clipping" in data:
            data = dict(data)
            clip = data.pop("gradient_clipping")
            optimizer = dict(data.get("optimizer") or {})
            if "grad_clip" in optimizer and optimizer["grad_clip"] != clip:
                raise ValueError(
                    f"gradient_clipping: {clip} disagrees with optimizer.grad_clip: "
                    f"{optimizer['grad_clip']}; give one"
                )
            optimizer["grad_clip"] = clip
            data["optimizer"] = optimizer
        return data

    @model_serializer(mode="wrap")
    def _write_gradient_clipping(self, handler, info) -> dict[str, Any]:
        """On the wire (by alias) gradient clipping is Cortex's top-level ``gradient_clipping``."""
        out = handler(self)
        if info.by_alias and isinstance(out.get("optimizer"), dict):
            out["optimizer"] = dict(out["optimizer"])
            out["gradient_clipping"] = out["optimizer"].pop("grad_clip", 1.0)
        return out


class InferenceSettings(_WithPassthrough):
    """``inference_config`` of a sampling or log-probability sub-job."""

    passthrough_keys: ClassVar[frozenset[str]] = CORTEX_INFERENCE_PASSTHROUGH

    n_gpus: PositiveInt = 1
    max_seq_len: PositiveInt | None = None  # None: the model's context length
    max_batch_size: PositiveInt = 256
    max_tokens_per_microbatch: PositiveInt = 16384
    prompt_sharing: PromptSharing = "auto"
    # How a log-prob sub-job scores through the LM head (a sampling sub-job does not score).
    logits: LogitsSettings = LogitsSettings()
    # Which sampling engine: ours or vLLM (None: the server's default, fixed at job creation).
    engine: SamplingEngineName | None = None
    # The vLLM settings (:class:`VllmSettings`: ours, then vLLM engine arguments); the Cortex API
    # and older configs call it ``vllm_config``, folded in (``vllm`` wins key by key).
    vllm: dict[str, Any] = Field(default_factory=dict, serialization_alias="vllm_config")

    @classmethod
    def known_keys(cls) -> set[str]:
        return super().known_keys() | {"vllm_config"}

    @model_validator(mode="before")
    @classmethod
    def _fold_vllm_config(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "vllm_config" in data:
            data = dict(data)
            legacy = data.pop("vllm_config")
            if legacy is not None and not isinstance(legacy, Mapping):
                raise ValueError("vllm_config: expected a mapping (folded into vllm)")
            vllm = data.get("vllm")
            data["vllm"] = {**(legacy or {}), **(vllm if isinstance(vllm, Mapping) else {})}
        return data

    @field_validator("vllm")
    @classmethod
    def _check_vllm(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            VllmSettings.model_validate(value)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise ValueError(f"{where}: {error['msg']}") from None
        return value

    @property
    def vllm_settings(self) -> VllmSettings:
        return VllmSettings.model_validate(self.vllm)


class SourceCheckpoint(_Spec):
    """Start a sub-job from a saved checkpoint (of this job or of ``source_job_id``)."""

    checkpoint_id: str = Field(min_length=1)
    source_job_id: str | None = None


class SubJobConfig(_Spec):
    """One engine of a job: its type, its model, and exactly the settings its type uses."""

    job_type: JobType | ApiJobType
    model_name: str = Field(min_length=1)
    training_config: TrainingSettings | None = None
    inference_config: InferenceSettings | None = None
    global_batch_size: PositiveInt | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: Seed | None = None
    post_init_hooks: list[str] = Field(default_factory=list, alias="model_post_init")
    source_checkpoint_info: SourceCheckpoint | None = None

    @model_validator(mode="after")
    def _settings_match_type(self) -> SubJobConfig:
        if self.kind == "training":
            if self.inference_config is not None:
                raise ValueError("inference_config: a training sub-job takes training_config")
            if self.training_config is None:
                self.training_config = TrainingSettings()
        else:
            if self.training_config is not None:
                raise ValueError(
                    f"training_config: a {self.job_type} sub-job takes inference_config"
                )
            if self.inference_config is None:
                self.inference_config = InferenceSettings()
            if self.kind == "log_prob" and self.inference_config.engine == "vllm":
                raise ValueError(
                    "inference_config.engine: vllm runs sampling sub-jobs; a log-prob sub-job "
                    "scores with our engine"
                )
        if self.post_init_hooks:
            raise ValueError(
                "model_post_init: no model post-init hooks are available on this server"
            )
        return self

    @property
    def kind(self) -> JobType:
        """The short job type used in sub-job ids (``log_probability`` -> ``log_prob``)."""
        return SHORT_JOB_TYPE[self.job_type]

    @property
    def ignored_settings(self) -> dict[str, Any]:
        """Foreign keys this server accepted but does not act on."""
        settings = self.training_config or self.inference_config
        ignored = dict(settings.ignored) if settings is not None else {}
        if self.inference_config is not None and self.inference_config.engine != "vllm":
            unused = set(self.inference_config.vllm) - VLLM_KEYS_USED
            ignored.update({f"vllm_config.{k}": self.inference_config.vllm[k] for k in unused})
        return ignored


class CreateJobRequest(_Spec):
    """Body of the Cortex create-job route (and of the in-process job creation)."""

    sub_job_configs: list[SubJobConfig] = Field(min_length=1)
    experiment_name: str | None = None
