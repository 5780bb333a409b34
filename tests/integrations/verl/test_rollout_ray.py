"""The ``arctic`` rollout on real Ray: the token server as the actor verl's trainer talks to.

The driver creates the jobs with the plugin's default backend (``http``: an ``arctic-platform
serve`` process it launches), builds :class:`ArcticRolloutReplica` with the trainer's
``main_config`` and ``backend_handle`` and awaits ``launch_servers()``, which starts
:class:`ArcticTokenServer` as a Ray actor in a fresh worker process. The tests then call that actor
the way verl's ``LLMServerClient`` does and compare its answers with the driver's own greedy
generation on the same sampling job.

A fresh Ray worker has no ``verl.remote_backend`` (no verl release has it; the tests use a
stand-in). This module therefore runs its own Ray cluster whose job ``runtime_env`` installs the
stand-in in every worker (``worker_process_setup_hook``). It deliberately does not pass
``VERL_USE_EXTERNAL_MODULES`` to the workers (a cluster started with ``ray start`` would not have
it either): the token server registers the plugin itself. A cluster started earlier without that
hook (``tests/ray``) is stopped for the module and started again afterwards with its usual
settings.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest
import ray

from tests.integrations.verl.conftest import STANDIN_NAMES, load_standin
from tests.ray.cluster import NUM_CPUS, start_ray

REPO_ROOT = Path(__file__).resolve().parents[3]
WORKER_HOOK = f"{__name__}.install_standin_in_worker"
RESPONSE_LENGTH = 6  # data.max_response_length of the tiny overrides
# What verl's agent loop sends for a greedy rollout (rollout.temperature=0, calculate_log_probs).
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
PROMPTS = ([40, 41, 42], [50, 23, 61, 70, 12])


def install_standin_in_worker() -> None:
    """Ray's ``worker_process_setup_hook``: the stand-in ``verl.remote_backend`` in this worker's
    ``sys.modules`` before anything imports verl."""
    module = load_standin()
    for name in STANDIN_NAMES:
        sys.modules[name] = module


@pytest.fixture(scope="module")
def ray_with_standin():
    """A Ray cluster whose workers can import the plugin (see the module doc)."""
    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(
        address="local",  # private: never a cluster that merely runs on this machine
        num_cpus=NUM_CPUS,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": WORKER_HOOK,
            "env_vars": {"PYTHONPATH": python_path},
        },
    )
    yield
    ray.shutdown()
    if was_running:
        start_ray()


@pytest.fixture(scope="module")
def rollout(ray_with_standin, compose_verl, tmp_path_factory):
    """The driver's backend and the launched replica; shut down (and checked) afterwards."""
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper
    from arctic_platform.integrations.verl.rollout import ArcticRolloutReplica

    config = compose_verl(
        "remote_backend.arctic.backend=http",
        f"remote_backend.arctic.http.data_dir={tmp_path_factory.mktemp('rollout_ray')}",
        "remote_backend.arctic.http.device=cpu",
    )
    backend = ArcticRLClientWrapper.from_config(config)
    handle = backend.reconnect_handle()
    rollout_config = config.actor_rollout_ref.rollout
    # As verl's LLMServerManager builds it, with the remote-backend trainer's replica kwargs.
    replica = ArcticRolloutReplica(
        replica_rank=0,
        config=rollout_config,
        model_config=config.actor_rollout_ref.model,
        gpus_per_node=rollout_config.n_gpus_per_node,
        main_config=config,
        backend_handle=handle,
    )
    try:
        asyncio.run(replica.launch_servers())
        yield backend, handle, replica
    finally:
        servers = list(replica.servers)
        for server in servers:
            ray.kill(server)
        backend.destroy()
    url = handle["rl_client_reconnect_config"]["backend"]["url"]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get([server.set_global_steps.remote(0) for server in servers], timeout=30)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def _greedy_reference(backend, prompt_ids):
    """The driver's own greedy completion of ``prompt_ids`` on the same sampling job."""
    params = {"temperature": 0.0, "max_tokens": RESPONSE_LENGTH, "logprobs": 0}
    return asyncio.run(backend.generate(prompt_ids, params))


def _generate(replica, prompt_ids, request_id, **params):
    """One call of the token server the way verl's ``LLMServerClient`` makes it."""
    call = replica.server_handle.generate.remote(
        request_id=request_id,
        prompt_ids=list(prompt_ids),
        sampling_params={**GREEDY, **params},
        image_data=None,
        video_data=None,
    )
    return ray.get(call, timeout=120)


def _asleep(backend):
    """What the sampler holds released right now (a wake of nothing it released: no change)."""
    return asyncio.run(backend.wake_inference(["weights"]))["sampling"]["asleep"]


def test_the_handle_reaches_the_drivers_server_and_jobs(rollout):
    backend, handle, replica = rollout
    reconnect = handle["rl_client_reconnect_config"]
    assert handle["rl_server_state"] is None  # the HTTP backend attaches by URL and job ids alone
    assert reconnect["backend"]["url"].startswith("http://127.0.0.1:")
    assert reconnect["backend"]["launch_local_server"] is False
    assert reconnect["sampling_job_id"] == backend.client.sampling_job_id
    assert replica.servers == [replica.server_handle] and replica.server_address is None


def test_the_actor_generates_the_drivers_greedy_tokens(rollout):
    backend, _, replica = rollout
    for i, prompt in enumerate(PROMPTS):
        expected = _greedy_reference(backend, prompt)
        out = _generate(replica, prompt, f"greedy-{i}", logprobs=True)
        assert out.token_ids == expected["token_ids"]
        # No max_tokens from verl: the completion may use rollout.response_length.
        assert expected["finish_reason"] != "length" or len(out.token_ids) == RESPONSE_LENGTH
        assert out.log_probs == pytest.approx(
            [entry["logprob"] for entry in expected["logprobs"]], abs=1e-5
        )
        assert out.stop_reason == "completed"
        assert out.extra_fields == {"global_steps": None}
    plain = _generate(replica, PROMPTS[0], "no-logprobs", logprobs=False, max_tokens=2)
    assert plain.log_probs is None
    assert plain.token_ids == _greedy_reference(backend, PROMPTS[0])["token_ids"][:2]


def test_the_trainers_lifecycle_calls_reach_the_sampler(rollout):
    backend, _, replica = rollout
    assert replica.config.free_cache_engine  # so sleep releases the KV cache
    assert _asleep(backend) == []
    asyncio.run(replica.sleep())
    assert _asleep(backend) == ["kv_cache"]
    asyncio.run(replica.wake_up())
    assert _asleep(backend) == []
    asyncio.run(replica.release_kv_cache())
    assert _asleep(backend) == ["kv_cache"]
    asyncio.run(replica.resume_kv_cache())
    assert _asleep(backend) == []
    asyncio.run(replica.clear_kv_cache())
    asyncio.run(replica.set_global_steps(5))
    out = _generate(replica, PROMPTS[1], "after-lifecycle")
    assert out.extra_fields == {"global_steps": 5}
    assert out.token_ids == _greedy_reference(backend, PROMPTS[1])["token_ids"]
