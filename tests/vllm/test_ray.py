"""A sampling job with ``sampling.engine=vllm`` on the Ray backend.

The replica actor builds the vLLM engine like any sampling engine, so the vLLM process runs as the
actor's child: greedy output equals our sampler's on the same model, before and after a weight sync
that travels through the object-store chunk stream (loaded by ``reload``, ``auto`` on CPU, which
``test_weight_sync.py`` checks against a fresh engine).
"""

from __future__ import annotations

import pytest

from tests.ray.cluster import ray_backend, start_ray
from tests.vllm.conftest import check_job_generates_and_syncs, needs_vllm

pytest.importorskip("ray")
pytestmark = [needs_vllm, pytest.mark.slow]


def test_vllm_sampling_job_on_ray(tmp_path):
    start_ray()
    config = {
        "model": "builtin:tiny",
        "seed": 0,
        "backend": ray_backend(tmp_path / "data"),
        "training": {"optimizer": {"lr": 1e-3}},
        "sampling": {"engine": "vllm"},
    }
    check_job_generates_and_syncs(config, "reload")
