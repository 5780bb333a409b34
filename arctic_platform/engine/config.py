"""Typed settings of the engines: the model, the optimizer, the schedule and the job knobs.

These are the engine's own contract. The client's YAML (``ArcticRLClientConfig``) and the server's
job-creation bodies are mapped onto them at their edges, so every backend builds its engines from
the same validated objects. All models forbid unknown fields so a typo fails loudly.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class LoraConfig(_Strict):
    """Low-rank adapters through peft; only the adapter weights train."""

    r: PositiveInt = 8
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"


class ModelConfig(_Strict):
    """Which weights to load and how.

    ``name`` is a local path, a hub name, or a built-in model (``builtin:tiny``, ``builtin:small``).
    ``dtype="auto"`` means float32 on CPU (bf16 is slower than fp32 on CPUs) and bfloat16 on CUDA.
    """

    name: str = Field(min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    lora: LoraConfig | None = None


class OptimizerConfig(_Strict):
    """AdamW hyper-parameters and gradient clipping (``grad_clip <= 0`` disables clipping)."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = 1.0


class SchedulerConfig(_Strict):
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay.

    ``total_steps`` is required by the decaying schedules; ``min_lr_ratio`` is the floor they
    decay to, as a fraction of the peak learning rate.
    """

    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: PositiveInt | None = None
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


class TrainingEngineConfig(_Strict):
    """Everything a training job needs to build its model, optimizer and microbatcher.

    ``max_tokens_per_microbatch`` bounds the tokens one model call sees; with ``packing`` (the
    default) sequences of varying length are packed, padding-free, into rows no longer than the
    longest sequence, and rows are stacked into microbatches within that budget.
    Checkpoints go to ``<checkpoint_dir>/<job_name>/checkpoint-<step>/``.
    """

    model: ModelConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    max_tokens_per_microbatch: PositiveInt = 16384
    packing: bool = True
    gradient_checkpointing: bool = False
    seed: int = 42
    checkpoint_dir: str | None = None
    job_name: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")
    save_total_limit: PositiveInt | None = None


SamplingEngineName = Literal["torch", "vllm"]


class VllmSettings(BaseModel):
    """How the vLLM sampling engine runs (``sampling.vllm``; the legacy ``vllm_config``).

    ``python`` is the interpreter of the environment that has vLLM (default:
    ``$ARCTIC_VLLM_PYTHON``, else this interpreter when it can import vllm). ``weight_sync`` picks
    how synced weights reach the running engine: ``restart`` builds a new vLLM engine on them,
    ``reload`` loads them into the running one, ``auto`` restarts on CPU and reloads on GPU.
    ``env`` adds environment variables for the vLLM process (``VLLM_CPU_KVCACHE_SPACE``, ...).
    Every other key is a vLLM engine argument (``enforce_eager``, ``gpu_memory_utilization``, ...),
    checked against the installed vLLM when the engine starts; ``max_num_seqs`` and
    ``max_model_len`` also bound our own sampler.
    """

    model_config = ConfigDict(extra="allow", validate_default=True)

    python: str | None = Field(None, min_length=1)
    weight_sync: Literal["auto", "reload", "restart"] = "auto"
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: PositiveFloat = 600.0

    @model_validator(mode="after")
    def _model_is_the_jobs(self) -> VllmSettings:
        if "model" in self.engine_args:
            raise ValueError("model: the job's model is what vLLM loads; set it there")
        return self

    @property
    def engine_args(self) -> dict[str, Any]:
        """The vLLM engine arguments: every key that is not one of ours."""
        return dict(self.model_extra or {})


class SamplingEngineConfig(_Strict):
    """Everything a sampling (or reference log-prob) job needs.

    ``max_batch_size`` bounds how many sequences decode together; ``max_model_len`` bounds prompt
    plus completion (defaults to the model's ``max_position_embeddings``).
    ``max_tokens_per_microbatch`` bounds the padded prompt tokens of one prefill forward;
    ``max_kv_cache_bytes`` bounds the key/value cache of one decoding wave (rows x (prompt +
    completion) x bytes per token), so a batch of long sequences decodes in several waves rather
    than exhausting memory. ``max_logprobs`` caps the ``logprobs`` a request may ask for, and
    ``seed`` seeds the draws of requests that do not bring their own. ``engine`` picks the
    engine: ours (``torch``, the default) or vLLM in its own process (``vllm``, set up by
    ``vllm``).
    """

    model: ModelConfig
    max_batch_size: PositiveInt = 256
    max_model_len: PositiveInt | None = None
    max_tokens_per_microbatch: PositiveInt = 16384
    max_kv_cache_bytes: PositiveInt = 4 * 1024**3
    max_logprobs: PositiveInt = 20
    seed: int = 42
    engine: SamplingEngineName = "torch"
    vllm: VllmSettings = VllmSettings()
