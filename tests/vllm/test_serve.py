"""``arctic-platform serve --sampling-engine vllm``: the server's default engine over HTTP.

A real ``serve`` process started with ``--sampling-engine vllm --vllm-python ...``; a client over
the on-prem HTTP API creates a training and a sampling job without naming an engine, so its
sampler is vLLM: greedy output equals our sampler's on the same model, and weight sync reaches it
(by ``reload``, the CPU default). A job that tries to name its own vLLM interpreter is refused.
"""

from __future__ import annotations

import pytest

from arctic_platform.client import InvalidRequestError, create_arctic_rl_client
from arctic_platform.client.local_server import LocalServer, free_port
from tests.vllm.conftest import VLLM_PYTHON, check_job_generates_and_syncs, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]


def test_serve_with_vllm_as_the_default_sampling_engine(tmp_path):
    server = LocalServer(
        port=free_port(),
        data_dir=tmp_path / "server",
        device="cpu",
        extra_args=("--sampling-engine", "vllm", "--vllm-python", str(VLLM_PYTHON)),
    )
    with server as url:
        config = {
            "model": "builtin:tiny",
            "seed": 0,
            "backend": {"type": "http", "url": url},
            "training": {"optimizer": {"lr": 1e-3}},
            "sampling": {},
        }
        check_job_generates_and_syncs(config, "reload")

        named = {**config, "training": None}
        named["sampling"] = {"vllm": {"python": str(VLLM_PYTHON)}}
        with pytest.raises(InvalidRequestError, match="vllm_config.python: this server runs vLLM"):
            create_arctic_rl_client(named, blocking_calls=True)
