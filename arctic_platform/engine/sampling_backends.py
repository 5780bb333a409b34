"""The sampling engine a job's config selects: ours (``torch``, the default) or vLLM's.

Both have the same ops and result shapes (``generate``, ``load_weights``, ``sleep``, ``wake``,
``reset_prefix_cache``), so the sampling job, weight sync and every transport use either one
without knowing which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arctic_platform.engine.config import SamplingEngineConfig


def build_sampling_engine(config: SamplingEngineConfig) -> Any:
    """A ``SamplingEngine`` (``engine: torch``) or a ``VllmSamplingEngine`` (``engine: vllm``)."""
    if config.engine == "vllm":
        from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine

        return VllmSamplingEngine(config)
    from arctic_platform.engine.sampler import SamplingEngine

    return SamplingEngine(config)


def check_before_start(config: SamplingEngineConfig) -> None:
    """Refuse, before any engine or process starts, what the engine on ``config`` would fail on
    at start: for vLLM on CPU, a memory budget that cannot fit here
    (:func:`~arctic_platform.engine.vllm_backend.cpu_budget.plan_cpu_memory`). Raises
    :class:`~arctic_platform.engine.errors.EngineInputError`; the server calls it at job creation.
    A model that is not a local model directory is left to the engine (which refuses it)."""
    if config.engine != "vllm":
        return
    from transformers import AutoConfig

    from arctic_platform.engine.builtin import resolve_model_path
    from arctic_platform.engine.models import resolve_device, resolve_dtype
    from arctic_platform.engine.sampling_requests import checked_max_model_len, model_context
    from arctic_platform.engine.vllm_backend.cpu_budget import plan_cpu_memory
    from arctic_platform.engine.vllm_backend.environment import worker_env

    model = config.model
    device = resolve_device(model.device)
    source = Path(resolve_model_path(model.name))
    if device.type != "cpu" or not source.is_dir():
        return
    try:
        hf_config = AutoConfig.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError):  # not a model directory: the engine's start says why
        return
    max_model_len = checked_max_model_len(config.max_model_len, model_context(hf_config))
    dtype = resolve_dtype(model.dtype, device)
    env = worker_env(config.vllm.env, device)
    plan_cpu_memory(config, hf_config, dtype, max_model_len, env)
