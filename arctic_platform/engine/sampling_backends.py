"""The sampling engine a job's config selects: ours (``torch``, the default) or vLLM's.

Both have the same ops and result shapes (``generate``, ``load_weights``, ``sleep``, ``wake``,
``reset_prefix_cache``), so the sampling job, weight sync and every transport use either one
without knowing which.
"""

from __future__ import annotations

from typing import Any

from arctic_platform.engine.config import SamplingEngineConfig


def build_sampling_engine(config: SamplingEngineConfig) -> Any:
    """A ``SamplingEngine`` (``engine: torch``) or a ``VllmSamplingEngine`` (``engine: vllm``)."""
    if config.engine == "vllm":
        from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine

        return VllmSamplingEngine(config)
    from arctic_platform.engine.sampler import SamplingEngine

    return SamplingEngine(config)
