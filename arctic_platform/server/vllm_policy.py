"""What a tenant's job may set of the vLLM process a shared server starts for it.

A job's ``sampling.vllm`` (``vllm_config``) reaches a process the server starts as its own user:
``env`` becomes that process's environment and every other key a vLLM engine argument. On a
server that confines tenants to their space (``serve``), a job could otherwise run code as the
server (``LD_PRELOAD``, ``PYTHONPATH``, ``VLLM_PLUGINS``, ``trust_remote_code``), read files
outside its space (``tokenizer``, ``download_dir``, ``speculative_config.model``) or see devices
it was not given (``CUDA_VISIBLE_DEVICES``). So there a job sets only what sizes and tunes the
engine it was given, the knobs RL frameworks send (verl's and SkyRL's ``vllm_config``); any other
key is a 400 naming it when the job is created, before any process starts. The interpreter is
the operator's (``serve --vllm-python``). In process, the user runs vLLM as themselves and sets
what they like.
"""

from __future__ import annotations

from arctic_platform.contract.settings import VllmSettings
from arctic_platform.server.errors import BadRequest

# Environment variables a tenant's job may give its vLLM process: its KV cache's size on CPU.
TENANT_ENV = frozenset({"VLLM_CPU_KVCACHE_SPACE"})
# Engine arguments a tenant's job may set: sizes, batching, caching and numerics of its engine.
TENANT_ENGINE_ARGS = frozenset(
    {
        "async_scheduling",
        "block_size",
        "disable_log_stats",
        "dtype",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "enforce_eager",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "max_logprobs",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "quantization",
        "seed",
        "swap_space",
        "tensor_parallel_size",
    }
)


def check_tenant_vllm(settings: VllmSettings, *, field: str, starts_vllm: bool) -> None:
    """Refuse (400 naming ``field``'s key) what a tenant's job may not set of a vLLM process (see
    the module doc): the interpreter, always; when the job ``starts_vllm``, an environment
    variable beyond :data:`TENANT_ENV` or an engine argument beyond :data:`TENANT_ENGINE_ARGS`
    (for our engine they are unused, reported in the job's ``ignored_settings``)."""
    if settings.python is not None:
        raise BadRequest(
            f"{field}.python: this server runs vLLM with the interpreter its operator chose "
            "(serve --vllm-python); a job cannot name one",
            field=f"{field}.python",
        )
    if not starts_vllm:
        return
    env = sorted(set(settings.env) - TENANT_ENV)
    if env:
        raise BadRequest(
            f"{field}.env.{env[0]}: a job on this server may set only {sorted(TENANT_ENV)} in its "
            "vLLM process's environment (others can load code or reach what the job was not "
            "given)",
            field=f"{field}.env.{env[0]}",
        )
    args = sorted(set(settings.engine_args) - TENANT_ENGINE_ARGS)
    if args:
        raise BadRequest(
            f"{field}.{args[0]}: a job on this server may not set this vLLM engine argument (it "
            "can name files or code the server would load, or resources the job was not given); "
            f"allowed: {sorted(TENANT_ENGINE_ARGS)}",
            field=f"{field}.{args[0]}",
        )
