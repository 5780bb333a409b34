"""What a client sends to create a job, and how it becomes engine configuration.

One shape serves every backend: the Cortex/SnowAPI ``SubJobConfig`` (job type, model, a
``training_config`` or an ``inference_config``, dtype, seed, optional source checkpoint), with the
knobs our engines add (schedule, microbatch token budget, packing, LoRA). The in-process transport,
the on-prem ``/initialize`` route and the Cortex create-job route all validate this model, so a typo
fails the same way everywhere: unknown keys are errors that name the key. Keys that Cortex defines
for its own GPU stack (DeepSpeed configs, expert parallelism, ...) are accepted and recorded as
ignored, so clients written for Cortex keep working.

Importing this module needs only pydantic: the client builds these objects without torch.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from arctic_platform.engine.config import (
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    SamplingEngineConfig,
    SamplingEngineName,
    SchedulerConfig,
    TrainingEngineConfig,
    VllmSettings,
)

JobType = Literal["training", "sampling", "log_prob"]
ApiJobType = Literal["training", "sampling", "log_probability"]
API_JOB_TYPE: dict[str, ApiJobType] = {
    "training": "training",
    "sampling": "sampling",
    "log_prob": "log_probability",
}
SHORT_JOB_TYPE: dict[str, JobType] = {
    "training": "training",
    "sampling": "sampling",
    "log_probability": "log_prob",
    "log_prob": "log_prob",
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
# vLLM engine arguments that mean something on our sampler; with the torch engine the rest are
# recorded as ignored (the vLLM engine uses them all).
VLLM_KEYS_USED = frozenset({"max_num_seqs", "max_model_len"})


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OptimizerSpec(_Spec):
    """Cortex's ``optimizer`` object (``{"name": "AdamW", "lr": 1e-4, ...}``)."""

    name: Literal["AdamW", "adamw", "Adam", "adam"] = "AdamW"
    lr: float = Field(1e-5, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: NonNegativeFloat = 0.0


class PeftSpec(_Spec):
    """Cortex's ``peft_config`` (LoRA; r and alpha default to 8 as in the Cortex API)."""

    peft_type: Literal["Lora", "LORA", "lora"] = "Lora"
    r: PositiveInt = 8
    lora_alpha: float = Field(8.0, alias="alpha")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, alias="dropout")
    target_modules: list[str] | Literal["all-linear"] = "all-linear"

    def to_lora(self) -> LoraConfig:
        return LoraConfig(
            r=self.r,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            target_modules=self.target_modules,
        )


class _WithPassthrough(_Spec):
    """Accepts a fixed set of foreign keys and remembers them instead of failing."""

    passthrough_keys: ClassVar[frozenset[str]] = frozenset()
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


class TrainingSettings(_WithPassthrough):
    """``training_config`` of a training sub-job."""

    passthrough_keys: ClassVar[frozenset[str]] = CORTEX_TRAINING_PASSTHROUGH

    n_gpus: PositiveInt = 1
    max_seq_len: PositiveInt = 4096
    train_batch_size: PositiveInt | None = None
    optimizer: OptimizerSpec = OptimizerSpec()
    gradient_clipping: float = 1.0
    lr_scheduler: SchedulerConfig = SchedulerConfig()
    max_tokens_per_microbatch: PositiveInt = 16384
    packing: bool = True
    activation_checkpointing: bool = False
    attn_implementation: str | None = None
    peft_config: PeftSpec | None = None
    save_total_limit: PositiveInt | None = None
    load_optimizer_states: bool = True
    data_parallel: Literal["ddp", "fsdp"] = "ddp"


class InferenceSettings(_WithPassthrough):
    """``inference_config`` of a sampling or log-probability sub-job."""

    passthrough_keys: ClassVar[frozenset[str]] = CORTEX_INFERENCE_PASSTHROUGH

    n_gpus: PositiveInt = 1
    max_seq_len: PositiveInt | None = None  # None: the model's context length
    max_batch_size: PositiveInt = 256
    max_tokens_per_microbatch: PositiveInt = 16384
    # Which sampling engine: ours or vLLM (None: the server's default, fixed at job creation).
    engine: SamplingEngineName | None = None
    # The vLLM settings (:class:`VllmSettings`: ours, then vLLM engine arguments).
    vllm_config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("vllm_config")
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
    def vllm(self) -> VllmSettings:
        return VllmSettings.model_validate(self.vllm_config)


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
    seed: int | None = None
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
            unused = set(self.inference_config.vllm_config) - VLLM_KEYS_USED
            ignored.update(
                {f"vllm_config.{k}": self.inference_config.vllm_config[k] for k in unused}
            )
        return ignored


class CreateJobRequest(_Spec):
    """Body of the Cortex create-job route (and of the in-process job creation)."""

    sub_job_configs: list[SubJobConfig] = Field(min_length=1)
    experiment_name: str | None = None


def model_config_of(
    spec: SubJobConfig, *, model_name: str | None = None, device: str
) -> ModelConfig:
    """The engine's model settings for a sub-job (``model_name`` overrides, e.g. a checkpoint)."""
    training = spec.training_config  # None for inference sub-jobs: they hold plain weights
    peft = training.peft_config if training is not None else None
    return ModelConfig(
        name=model_name or spec.model_name,
        dtype=spec.dtype,
        device=device,
        attn_implementation=training.attn_implementation if training is not None else None,
        lora=peft.to_lora() if peft is not None else None,
    )


def training_engine_config(
    spec: SubJobConfig,
    *,
    device: str,
    checkpoint_dir: str,
    job_name: str,
    default_seed: int = 42,
    model_name: str | None = None,
) -> TrainingEngineConfig:
    """Map a training sub-job onto :class:`TrainingEngineConfig` (``model_name`` overrides the
    spec's, e.g. with the checked local folder it names)."""
    settings = spec.training_config
    assert settings is not None
    optimizer = settings.optimizer
    return TrainingEngineConfig(
        model=model_config_of(spec, model_name=model_name, device=device),
        optimizer=OptimizerConfig(
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
            grad_clip=settings.gradient_clipping,
        ),
        scheduler=settings.lr_scheduler,
        max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
        packing=settings.packing,
        gradient_checkpointing=settings.activation_checkpointing,
        seed=default_seed if spec.seed is None else spec.seed,
        checkpoint_dir=checkpoint_dir,
        job_name=job_name,
        save_total_limit=settings.save_total_limit,
    )


def sampling_engine_config(
    spec: SubJobConfig,
    *,
    device: str,
    default_seed: int = 42,
    model_name: str | None = None,
    vllm_python: str | None = None,
) -> SamplingEngineConfig:
    """Map a sampling or log-probability sub-job onto :class:`SamplingEngineConfig`
    (``vllm_python``: the server operator's vLLM interpreter, used unless the job names one)."""
    settings = spec.inference_config
    assert settings is not None
    vllm = settings.vllm
    engine_args = vllm.engine_args
    if vllm.python is None and vllm_python is not None:
        vllm = vllm.model_copy(update={"python": vllm_python})
    return SamplingEngineConfig(
        model=model_config_of(spec, model_name=model_name, device=device),
        max_batch_size=engine_args.get("max_num_seqs", settings.max_batch_size),
        max_model_len=engine_args.get("max_model_len", settings.max_seq_len),
        max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
        seed=default_seed if spec.seed is None else spec.seed,
        engine=settings.engine or "torch",
        vllm=vllm,
    )
