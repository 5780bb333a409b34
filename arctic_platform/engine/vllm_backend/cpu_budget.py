"""How much memory vLLM gets on CPU: sized from the job, checked before any process starts.

vLLM's CPU worker sizes its KV cache from the machine unless told otherwise: it reserves
``gpu_memory_utilization`` (0.92 by default) of the memory of the NUMA node it binds to, and
refuses to start when that much is not free, which fails on any machine where other work runs
(our own training job among it). Given ``kv_cache_memory_bytes`` (the engine argument) or
``VLLM_CPU_KVCACHE_SPACE`` (the environment, in GiB, which wins over the argument) it allocates
exactly that instead, and with eager execution it also skips the warm-up pass it needs only to
measure the rest (``vllm/v1/worker/cpu_worker.py``).

So on CPU the sampling engine passes ``kv_cache_memory_bytes`` sized from what the job needs:
``max_num_seqs`` sequences of ``max_model_len`` tokens (rounded up to vLLM's CPU KV block of 128
tokens), at the model's KV bytes per token (:func:`~arctic_platform.engine.models.
kv_bytes_per_token`) in the served dtype, capped at ``max_kv_cache_bytes`` (the bound our own
sampler keeps its running batch within: vLLM schedules more sequences than fit in turns, as ours
lets them wait for rows to free up) but never below one whole ``max_model_len`` sequence (vLLM
refuses to start without room for one). An explicit ``kv_cache_memory_bytes``,
``VLLM_CPU_KVCACHE_SPACE`` or ``gpu_memory_utilization`` in ``sampling.vllm`` is the user's sizing
and is kept.

Whatever its source, the budget (KV cache plus the served weights) must fit in the memory vLLM
will find free, counted as vLLM counts it (the node's free memory, file cache and reclaimable
slab, within the cgroup's limit); otherwise :func:`plan_cpu_memory` raises
:class:`~arctic_platform.engine.errors.EngineInputError` naming ``sampling.vllm`` and the numbers,
which the server returns as a 400 at job creation, before any process starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.models import kv_bytes_per_token

FIELD = "sampling.vllm"
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's CPU KV cache size, in GiB
KV_BYTES_ARG = "kv_cache_memory_bytes"  # vLLM's engine argument for an explicit KV cache size
MEMORY_FRACTION_ARG = "gpu_memory_utilization"  # on CPU: the fraction of the node vLLM reserves
CPU_BLOCK_TOKENS = 128  # vLLM's default KV block on CPU (platforms/cpu.py)
_GIB = 1 << 30


@dataclass(frozen=True)
class CpuMemoryPlan:
    """What the vLLM process will hold: ``kv_cache_bytes`` (by ``source``) and the served
    ``weight_bytes``; ``engine_args`` are what the engine adds to vLLM's arguments for it."""

    source: str
    kv_cache_bytes: int
    weight_bytes: int
    engine_args: dict[str, int]

    def describe(self) -> dict:
        return {
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_cache_source": self.source,
            "weight_bytes": self.weight_bytes,
        }


def plan_cpu_memory(
    config: SamplingEngineConfig,
    hf_config,
    dtype: torch.dtype,
    max_model_len: int,
    env: Mapping[str, str],
) -> CpuMemoryPlan:
    """The vLLM CPU memory plan of a sampling engine on ``config`` (see the module docstring);
    ``env`` is the environment the vLLM process will start with. Raises
    :class:`EngineInputError` (field ``sampling.vllm``) when the budget cannot fit."""
    args = config.vllm.engine_args
    block = _number(args.get("block_size") or CPU_BLOCK_TOKENS, int, f"{FIELD}.block_size")
    per_token = kv_bytes_per_token(hf_config, dtype)
    one_sequence = math.ceil(max_model_len / block) * block * per_token
    node = node_memory()
    space = env.get(KV_SPACE_ENV, "")
    by_fraction = False  # a share of the node sizes the whole process, weights included
    if space:
        source = f"{FIELD}.env.{KV_SPACE_ENV}={space} GiB"
        kv_bytes = _number(space, int, f"{FIELD}.env.{KV_SPACE_ENV}") * _GIB
    elif args.get(KV_BYTES_ARG) is not None:  # a positive int: VllmSettings checked it
        source = f"{FIELD}.{KV_BYTES_ARG}"
        kv_bytes = args[KV_BYTES_ARG]
    elif args.get(MEMORY_FRACTION_ARG) is not None:
        share = _number(args[MEMORY_FRACTION_ARG], float, f"{FIELD}.{MEMORY_FRACTION_ARG}")
        source, by_fraction = f"{FIELD}.{MEMORY_FRACTION_ARG}={share}", True
        kv_bytes = math.ceil(node.total * share)
    else:
        need = config.max_batch_size * one_sequence
        source = (
            f"the job: max_num_seqs {config.max_batch_size} x max_model_len {max_model_len} x "
            f"{per_token} KV bytes per token, within max_kv_cache_bytes "
            f"{config.max_kv_cache_bytes}"
        )
        kv_bytes = max(one_sequence, min(need, config.max_kv_cache_bytes))
    weight_bytes = 0 if by_fraction else served_weight_bytes(hf_config, dtype)
    if not by_fraction and kv_bytes < one_sequence:
        raise EngineInputError(
            FIELD,
            f"a KV cache of {_gib(kv_bytes)} ({source}) cannot hold one sequence of "
            f"max_model_len {max_model_len} tokens, which needs {_gib(one_sequence)} "
            f"({per_token} bytes per token); raise it or lower max_model_len",
        )
    needed = kv_bytes + weight_bytes
    if needed > node.available:
        raise EngineInputError(
            FIELD,
            f"vLLM on CPU needs {_gib(needed)} (KV cache {_gib(kv_bytes)} from {source}, "
            f"weights {_gib(weight_bytes)}) and {_gib(node.available)} of "
            f"{_gib(node.total)} is free where it would run; lower max_num_seqs or "
            f"max_model_len, or size the KV cache with {FIELD}.{KV_BYTES_ARG} or "
            f"{FIELD}.env.{KV_SPACE_ENV}",
        )
    engine_args = {} if space or by_fraction else {KV_BYTES_ARG: kv_bytes}
    return CpuMemoryPlan(source, kv_bytes, weight_bytes, engine_args)


def _number(value, kind: type, field: str):
    """``value`` as a positive ``kind`` (vLLM's sizing settings), else refused naming ``field``."""
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or number <= 0:
        raise EngineInputError(field, f"expected a positive {kind.__name__}, got {value!r}")
    return number


def served_weight_bytes(hf_config, dtype: torch.dtype) -> int:
    """The bytes of the model's weights in ``dtype`` (counted on the meta device, tied weights
    once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass(frozen=True)
class NodeMemory:
    total: int
    available: int


def node_memory() -> NodeMemory:
    """Total and free memory where vLLM allocates on CPU, counted as vLLM counts it: the NUMA
    node of this process's first allowed CPU (vLLM binds its memory there), free memory plus
    file cache plus reclaimable slab, within the cgroup's limit; the machine's ``MemAvailable``
    where there are no nodes."""
    cpu = min(os.sched_getaffinity(0))
    nodes = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    info = _meminfo(Path(f"/sys/devices/system/node/{nodes[0].name}/meminfo")) if nodes else {}
    if info:
        total = info["MemTotal"]
        available = (
            info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
        )
    else:
        info = _meminfo(Path("/proc/meminfo"))
        total, available = info["MemTotal"], info["MemAvailable"]
    limit, usage = _cgroup_memory()
    if limit is not None and limit < total:
        total, available = limit, max(0, min(available, limit - usage))
    return NodeMemory(total, available)


def _meminfo(path: Path) -> dict[str, int]:
    """A meminfo file's ``kB`` fields in bytes (node files prefix each line with the node)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    fields = {}
    for line in lines:
        key, _, rest = line.partition(":")
        value = rest.split()
        if value:
            fields[key.split()[-1]] = int(value[0]) * 1024
    return fields


def _cgroup_memory() -> tuple[int | None, int]:
    """The cgroup's memory limit (None: unlimited) and usage, v2 or v1."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if not limit.isdigit() or int(limit) >= 1 << 62:  # "max" / v1's no-limit sentinel
            return None, 0
        try:
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            usage = 0
        return int(limit), usage
    return None, 0


def _gib(n: int) -> str:
    """``n`` bytes, exactly and readably."""
    readable = f"{n / _GIB:.2f} GiB" if n >= _GIB // 10 else f"{n / (1 << 20):.1f} MiB"
    return f"{n} bytes ({readable})"
