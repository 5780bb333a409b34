"""A sampling job with ``sampling.engine=vllm`` on the Ray backend.

The replica actor builds the vLLM engine like any sampling engine, so the vLLM process runs as the
actor's child: greedy output equals our sampler's on the same model, before and after a weight sync
that travels through the object-store chunk stream (loaded by ``reload``, which
``test_weight_sync.py`` checks against a fresh engine; cheaper than a restart).
"""

from __future__ import annotations

import pytest

from tests.ray.cluster import ray_backend, start_ray
from tests.vllm.conftest import VLLM_ENV, check_job_generates_and_syncs, needs_vllm

pytest.importorskip("ray")
pytestmark = [needs_vllm, pytest.mark.slow]


def test_vllm_sampling_job_on_ray(tmp_path):
    start_ray()
    config = {
        "model": "builtin:tiny",
        "seed": 0,
        "backend": ray_backend(tmp_path / "data"),
        "training": {"optimizer": {"lr": 1e-3}},
        "sampling": {"engine": "vllm", "vllm": {"env": VLLM_ENV, "weight_sync": "reload"}},
    }
    check_job_generates_and_syncs(config, "reload")
