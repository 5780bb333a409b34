"""How a validated sub-job config (:mod:`arctic_platform.contract.job_config`) becomes the
configuration of its engine.

The schema itself lives in the contract, shared with the client; this module is the server's
side of it: the engine settings are the very objects the schema holds.
"""

from __future__ import annotations

from arctic_platform.contract.job_config import SubJobConfig
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig, TrainingEngineConfig


def model_config_of(
    spec: SubJobConfig, *, model_name: str | None = None, device: str
) -> ModelConfig:
    """The engine's model settings for a sub-job (``model_name`` overrides, e.g. a checkpoint)."""
    training = spec.training_config  # None for inference sub-jobs: they hold plain weights
    return ModelConfig(
        name=model_name or spec.model_name,
        dtype=spec.dtype,
        device=device,
        attn_implementation=training.attn_implementation if training is not None else None,
        lora=training.lora if training is not None else None,
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
    return TrainingEngineConfig(
        model=model_config_of(spec, model_name=model_name, device=device),
        optimizer=settings.optimizer,
        scheduler=settings.schedule,
        max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
        packing=settings.packing,
        prompt_sharing=settings.prompt_sharing,
        logits=settings.logits,
        gradient_checkpointing=settings.gradient_checkpointing,
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
    vllm = settings.vllm_settings
    engine_args = vllm.engine_args
    if vllm.python is None and vllm_python is not None:
        vllm = vllm.model_copy(update={"python": vllm_python})
    off = engine_args.get("enable_prefix_caching") is False
    memory = {"prompt_cache_bytes": 0} if off else {}
    if engine_args.get("kv_cache_memory_bytes") is not None:
        memory["max_kv_cache_bytes"] = engine_args["kv_cache_memory_bytes"]
    return SamplingEngineConfig(
        model=model_config_of(spec, model_name=model_name, device=device),
        max_batch_size=engine_args.get("max_num_seqs", settings.max_batch_size),
        max_model_len=engine_args.get("max_model_len", settings.max_seq_len),
        max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
        prompt_sharing=settings.prompt_sharing,
        logits=settings.logits,
        seed=default_seed if spec.seed is None else spec.seed,
        engine=settings.engine or "torch",
        vllm=vllm,
        **memory,
    )
