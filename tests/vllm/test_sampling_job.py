"""The vLLM engine behind a sampling job: selected by config, synced, supervised.

A client (in-process backend) configures ``sampling: {engine: vllm}`` with a training job; its
generate and sync_weights run on the vLLM engine. A second job on the same server samples with our
engine. Killing the vLLM process fails the first job with a reason that says so, and nothing else:
the second job still generates, and new jobs can be created.
"""

from __future__ import annotations

import os
import signal

import pytest

from arctic_platform.client import ServerError, create_arctic_rl_client
from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine
from tests.sampled import sampled
from tests.vllm.conftest import needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]

GREEDY = {"temperature": 0.0, "max_tokens": 8}


def test_vllm_sampling_job_and_its_death(tmp_path):
    config = {
        "model": "builtin:tiny",
        "seed": 0,
        "backend": {"type": "inprocess", "data_dir": str(tmp_path / "data"), "device": "cpu"},
        "training": {"optimizer": {"lr": 1e-3}},
        "sampling": {"engine": "vllm", "vllm": {"enforce_eager": True}},
    }
    client = create_arctic_rl_client(config, blocking_calls=True)
    other = None
    try:
        service = client.get_server_state()
        sampling = service.resolve(client.sampling_job_id, owner=None)
        engine = sampling.engine
        assert isinstance(engine, VllmSamplingEngine)
        assert sampling.spec.ignored_settings == {}  # every vllm key is used by this engine
        assert client.generate(["1+1="], GREEDY)[0]["token_ids"]
        assert client.sync_weights()["targets"][0]["method"] == "reload"

        other = create_arctic_rl_client(
            {**config, "training": None, "sampling": {}}, server_state=service, blocking_calls=True
        )
        expected = other.generate(["1+1="], GREEDY)

        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(ServerError) as info:
            client.generate(["1+1="], GREEDY)
        assert info.value.status == 500
        assert "vLLM worker process" in info.value.message and "died" in info.value.message
        job = service.get_job(client.sampling_job_id.split(":")[0])
        assert job["status"] == "failed" and "killed by signal 9" in job["reason"]

        # the other job carries on
        assert sampled(other.generate(["1+1="], GREEDY)) == sampled(expected)
    finally:
        if other is not None:
            other.shutdown()
        client.shutdown()
