"""GPU-stack settings degrade, never fail, where the stack is absent: on every backend.

SkyRL's Arctic integration asks for ``attn_implementation: flash_attention_2`` by default. Where
``flash_attn`` is not installed (this machine; many GPU machines) the training job must still be
created, run its ops with transformers' default attention (sdpa), and say so: its info lists
``attn_implementation: flash_attention_2 -> sdpa (flash_attn is not installed)`` among its
``ignored_settings``, and its log has the line. Each backend gets one cheap training-only job.
"""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest

from arctic_platform.client import create_arctic_rl_client
from tests.client.conftest import TINY, backend_config
from tests.client.grpo import SCORING

BACKENDS = ("inprocess", "http", "cortex", "ray")
FALLBACK = "flash_attention_2 -> sdpa (flash_attn is not installed)"
BATCH = {
    "input_ids": np.array([[40, 41, 42, 43, 44], [50, 51, 52, 0, 0]], dtype=np.int64),
    "attention_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.int64),
}

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None,
    reason="flash_attn is installed here: there is nothing to fall back from",
)


def job_info(kind: str, client, url: str) -> dict:
    """The training job's info, read where that backend's users read it."""
    job_id = client.training_job_id.split(":", 1)[0]
    if kind == "inprocess":
        return client.get_server_state().get_job(job_id)
    if kind == "ray":
        import ray

        status, info = ray.get(client.get_server_state().get_job.remote(job_id))
        assert status == "ok", info
        return info
    from arctic_platform.client.config import CortexBackend
    from arctic_platform.client.jobs import ServerAddress, jobs_client

    if kind == "cortex":
        backend = CortexBackend.model_validate(backend_config("cortex", url, "unused"))
        address = ServerAddress(url=backend.prefix, cortex=backend)
    else:
        address = ServerAddress(url=url)
    with jobs_client(address) as jobs:
        return jobs.show(job_id)


@pytest.fixture(scope="module")
def sdpa_logprobs():
    """The same batch scored by an engine built with sdpa (the independent reference)."""
    from arctic_platform.engine.config import ModelConfig, TrainingEngineConfig
    from arctic_platform.engine.trainer import TrainingEngine

    model = ModelConfig(name=TINY, device="cpu", attn_implementation="sdpa")
    engine = TrainingEngine(TrainingEngineConfig(model=model))
    return engine.forward(BATCH, processing=SCORING)["logprobs"].numpy()


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.slow) if k == "ray" else k for k in BACKENDS]
)
def test_flash_attention_2_falls_back_to_sdpa_and_says_so(
    kind, server_url, tmp_path, sdpa_logprobs, caplog
):
    if kind == "ray":
        from tests.ray.cluster import ray_backend, start_ray

        start_ray()
        backend = ray_backend(tmp_path)
    else:
        backend = backend_config(kind, server_url, tmp_path)
    config = {
        "model": TINY,
        "tensor_type": "numpy",
        "backend": backend,
        "training": {"attn_implementation": "flash_attention_2"},
    }
    with caplog.at_level(logging.WARNING, logger="arctic_platform.engine.models"):
        client = create_arctic_rl_client(config, blocking_calls=True)
    try:
        scored = client.fwd_no_grad({"batch": BATCH, "processing": SCORING})
        np.testing.assert_array_equal(scored["batch"]["logprobs"], sdpa_logprobs)
        info = job_info(kind, client, server_url)
        (training,) = info["sub_jobs"]
        assert training["training_config"]["attn_implementation"] == "flash_attention_2"
        assert training["ignored_settings"]["attn_implementation"] == FALLBACK
        if kind != "ray":  # the engine loads in this process (the server's, for http/cortex)
            assert f"attn_implementation: {FALLBACK}" in caplog.text
    finally:
        client.shutdown()


def test_the_model_really_runs_sdpa_and_the_job_log_says_why(tmp_path):
    config = {
        "model": TINY,
        "backend": backend_config("inprocess", None, tmp_path),
        "training": {"attn_implementation": "flash_attention_2"},
    }
    client = create_arctic_rl_client(config, blocking_calls=True)
    try:
        service = client.get_server_state()
        sub = service.resolve(client.training_job_id, owner=None)
        assert sub.engine.model.config._attn_implementation == "sdpa"
        logs = "\n".join(map(str, service.tail_logs(sub.job_id)["entries"]))
        assert f"{sub.sub_job_id}: attn_implementation: {FALLBACK}" in logs
    finally:
        client.shutdown()


@pytest.mark.parametrize(
    ("requested", "why"),
    [
        ("flash_attention_3", "flash_attn_3 is not installed"),
        ("kernels-community/flash-attn2", "kernels is not installed"),
        ("paged|flash_attention_2", "flash_attn is not installed"),
    ],
)
def test_every_gpu_stack_attention_degrades_at_the_model_load(requested, why):
    from arctic_platform.engine.config import ModelConfig
    from arctic_platform.engine.models import load_causal_lm

    if importlib.util.find_spec(why.split()[0]) is not None:
        pytest.skip(f"{why.split()[0]} is installed here")
    fallbacks: dict[str, str] = {}
    config = ModelConfig(name=TINY, device="cpu", attn_implementation=requested)
    model = load_causal_lm(config, fallbacks=fallbacks)
    assert model.config._attn_implementation == "sdpa"
    assert fallbacks == {"attn_implementation": f"{requested} -> sdpa ({why})"}


def test_an_attention_that_runs_here_is_not_a_fallback():
    from arctic_platform.engine.config import ModelConfig
    from arctic_platform.engine.models import load_causal_lm

    fallbacks: dict[str, str] = {}
    for name in ("eager", "sdpa"):
        config = ModelConfig(name=TINY, device="cpu", attn_implementation=name)
        assert load_causal_lm(config, fallbacks=fallbacks).config._attn_implementation == name
    assert fallbacks == {}
