"""vLLM on CPU is sized from the job, and a budget that cannot fit is refused before it starts.

These tests start no vLLM process (the refusals come first), so they run without
``$ARCTIC_VLLM_PYTHON``. The budget is checked against an independent computation from the
built-in tiny model's ``config.json`` numbers; a refusal is a 400 naming ``sampling.vllm`` and the
numbers on the Cortex and on-prem routes and in process, and no job exists after it.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoConfig

from arctic_platform.client import ServerError, create_arctic_rl_client
from arctic_platform.engine.builtin import resolve_model_path
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.vllm_backend.cpu_budget import node_memory, plan_cpu_memory
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, TINY, make_app

GIB = 1 << 30
HUGE = str(1 << 20)  # GiB of KV cache: no machine has it


def tiny_kv_bytes_per_token() -> int:
    """From the model's own config file: K and V, every layer, every KV head, float32."""
    raw = json.loads((Path(resolve_model_path(TINY)) / "config.json").read_text())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * head_dim * 4


def plan(max_model_len: int | None = None, env: dict | None = None, **config):
    cfg = SamplingEngineConfig(model=ModelConfig(name=TINY), engine="vllm", **config)
    hf_config = AutoConfig.from_pretrained(resolve_model_path(TINY))
    length = max_model_len or hf_config.max_position_embeddings
    return plan_cpu_memory(cfg, hf_config, torch.float32, length, env or {})


def test_the_kv_cache_is_what_the_job_needs():
    per_token = tiny_kv_bytes_per_token()
    default = plan()  # 256 sequences of the model's 1024 positions
    assert default.kv_cache_bytes == 256 * 1024 * per_token
    assert default.engine_args == {"kv_cache_memory_bytes": 256 * 1024 * per_token}
    # Sequences take whole blocks of 128 tokens: 200 -> 256.
    assert plan(200, max_batch_size=8).kv_cache_bytes == 8 * 256 * per_token
    # Within our sampler's per-wave bound, but never below one whole sequence.
    assert plan(max_kv_cache_bytes=10 * 1024 * per_token).kv_cache_bytes == 10 * 1024 * per_token
    assert plan(max_kv_cache_bytes=1).kv_cache_bytes == 1024 * per_token
    # The user's own sizing is kept: vLLM reads these itself.
    explicit = plan(env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert (explicit.kv_cache_bytes, explicit.engine_args) == (GIB, {})
    by_arg = plan(vllm={"kv_cache_memory_bytes": 64 << 20})
    assert by_arg.engine_args == {"kv_cache_memory_bytes": 64 << 20}
    assert plan(vllm={"gpu_memory_utilization": 0.01}).engine_args == {}
    # The served weights count too: the tiny model's parameters in float32.
    model = load_causal_lm(ModelConfig(name=TINY))
    assert default.weight_bytes == 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("vllm", "field", "message"),
    [
        ({"env": {"VLLM_CPU_KVCACHE_SPACE": HUGE}}, "sampling.vllm", "is free where it would run"),
        ({"kv_cache_memory_bytes": 1000}, "sampling.vllm", "cannot hold one sequence"),
        ({"gpu_memory_utilization": 1.0}, "sampling.vllm", "is free where it would run"),
    ],
)
def test_a_budget_that_cannot_fit_is_refused(vllm, field, message):
    env = vllm.pop("env", None)
    with pytest.raises(EngineInputError, match=message) as info:
        plan(env=env, vllm=vllm)
    assert info.value.field == field


@pytest.mark.parametrize("value", ["lots", "1000", 0, True])
def test_a_kv_cache_size_that_is_not_a_positive_int_is_refused_with_the_config(value):
    """Refused where ``sampling.vllm`` is validated, before any plan, naming the key."""
    with pytest.raises(ValueError, match="kv_cache_memory_bytes: expected a positive"):
        plan(vllm={"kv_cache_memory_bytes": value})


@pytest.fixture
def http(tmp_path):
    """The real app over 127.0.0.1, on a CPU server."""
    service = Service(ServiceSettings(data_dir=tmp_path / "server", device="cpu"))
    try:
        with serve_app(make_app(service)) as url, httpx.Client(base_url=url, timeout=60) as client:
            yield client
    finally:
        service.close()


def test_a_budget_that_cannot_fit_is_a_400_at_creation_on_every_edge(http, tmp_path):
    vllm = {"env": {"VLLM_CPU_KVCACHE_SPACE": HUGE}}
    sampling = {
        "job_type": "sampling",
        "model_name": TINY,
        "inference_config": {"engine": "vllm", "vllm_config": vllm},
    }
    cortex = http.post(CORTEX, json={"sub_job_configs": [sampling]})
    onprem = http.post("/initialize", json=sampling)
    expected_kv = f"{int(HUGE) * GIB} bytes"
    for reply in (cortex, onprem):
        assert reply.status_code == 400, reply.text
        message = reply.json()["message"]
        assert "inference_config.vllm_config (sampling.vllm)" in message
        assert expected_kv in message and "VLLM_CPU_KVCACHE_SPACE" in message
        assert f"{node_memory().total} bytes" in message
    assert http.get(CORTEX).json()["jobs"] == []

    config = {
        "model": TINY,
        "backend": {"type": "inprocess", "data_dir": str(tmp_path / "data"), "device": "cpu"},
        "training": None,
        "sampling": {"engine": "vllm", "vllm": vllm},
    }
    with pytest.raises(ServerError) as info:
        create_arctic_rl_client(config, blocking_calls=True)
    assert info.value.status == 400
    assert "sampling.vllm" in info.value.message and expected_kv in info.value.message
