"""Typed settings of the engines: the model and the job knobs, composing the optimizer, schedule
and LoRA settings of :mod:`arctic_platform.contract.settings`.

The optimizer, schedule and LoRA models are defined once in the contract (pydantic only, so the
client can use them without torch); the server's job config and the client's YAML compose the
same models, so every backend builds its engines from the same validated objects. All models
forbid unknown fields so a typo fails loudly.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from arctic_platform.contract.settings import (
    LogitsSettings,
    LoraConfig,
    OptimizerConfig,
    PromptSharing,
    SamplingEngineName,
    SchedulerConfig,
    VllmSettings,
)

__all__ = [
    "LogitsSettings",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PromptSharing",
    "SamplingEngineConfig",
    "SamplingEngineName",
    "SchedulerConfig",
    "TrainingEngineConfig",
    "VllmSettings",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


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


class TrainingEngineConfig(_Strict):
    """Everything a training job needs to build its model, optimizer and microbatcher.

    ``max_tokens_per_microbatch`` bounds the tokens one model call sees; with ``packing`` (the
    default) sequences of varying length are packed, padding-free, into rows no longer than the
    longest sequence, and rows are stacked into microbatches within that budget.
    ``prompt_sharing`` (``auto``: when it saves work) runs a prompt shared by several rows once
    (:mod:`arctic_platform.engine.prompt_sharing`); ``off`` scores every row whole. ``logits``
    decides when the LM head runs in chunks (:class:`LogitsSettings`).
    Checkpoints go to ``<checkpoint_dir>/<job_name>/checkpoint-<step>/``.
    """

    model: ModelConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    max_tokens_per_microbatch: PositiveInt = 16384
    packing: bool = True
    prompt_sharing: PromptSharing = "auto"
    logits: LogitsSettings = LogitsSettings()
    gradient_checkpointing: bool = False
    seed: int = 42
    checkpoint_dir: str | None = None
    job_name: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")
    save_total_limit: PositiveInt | None = None


class SamplingEngineConfig(_Strict):
    """Everything a sampling (or reference log-prob) job needs.

    ``max_batch_size`` bounds how many sequences decode together; ``max_model_len`` bounds prompt
    plus completion (defaults to the model's ``max_position_embeddings``).
    ``max_tokens_per_microbatch`` bounds the padded prompt tokens of one prefill forward;
    ``max_kv_cache_bytes`` (a job's ``sampling.vllm.kv_cache_memory_bytes``) bounds the key/value
    cache of the running batch (each prefilled prompt once, however many samples decode from it,
    plus each row's completion, times the bytes per token): sequences that do not fit wait for
    running ones to finish rather than exhausting memory. ``prompt_cache_bytes`` bounds the prompts
    kept prefilled across calls (their keys, values and first-step logits; a prompt that starts
    like a kept one is prefilled only from where they part; least recently used leave first; ``0``:
    off; :mod:`.prompt_cache`); they also only take what the running batch leaves of
    ``max_kv_cache_bytes``, so the two together stay within it. ``continuous_batching`` (default
    on) lets calls from several threads decode together, a call arriving mid-decode joining at the
    next step; off, calls run one at a time. ``max_logprobs`` caps the ``logprobs`` a request may
    ask for, and ``seed`` seeds the draws of requests that do not bring their own. ``engine`` picks
    the engine: ours (``torch``, the default) or vLLM in its own process (``vllm``, set up by
    ``vllm``). ``prompt_sharing`` and ``logits`` are the training engine's knobs, for a log-prob
    (reference) job's scoring.
    """

    model: ModelConfig
    max_batch_size: PositiveInt = 256
    max_model_len: PositiveInt | None = None
    max_tokens_per_microbatch: PositiveInt = 16384
    max_kv_cache_bytes: PositiveInt = 4 * 1024**3
    prompt_cache_bytes: NonNegativeInt = 1024**3
    continuous_batching: bool = True
    max_logprobs: PositiveInt = 20
    prompt_sharing: PromptSharing = "auto"
    logits: LogitsSettings = LogitsSettings()
    seed: int = 42
    engine: SamplingEngineName = "torch"
    vllm: VllmSettings = VllmSettings()
