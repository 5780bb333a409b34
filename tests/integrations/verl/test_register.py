"""The plugin entry point: what ``VERL_USE_EXTERNAL_MODULES`` registers and what it leaves alone."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.integrations.verl.conftest import STANDIN_NAMES, STANDIN_PATH

ENTRY = "arctic_platform.integrations.verl.register"
# Our modules that pull in engines, models, servers or Ray actors: none may load with the plugin.
HEAVY = (
    "arctic_platform.engine.trainer",
    "arctic_platform.engine.sampler",
    "arctic_platform.engine.models",
    "arctic_platform.server.service",
    "arctic_platform.client.transports.inprocess",
    "arctic_platform.integrations.verl.worker",
    "arctic_platform.integrations.verl.rollout",
    "transformers.models.llama.modeling_llama",
    "verl.workers.engine_workers",
    "vllm",
)

SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys

    # The stand-in for the unreleased verl.remote_backend, in place before verl imports plugins.
    spec = importlib.util.spec_from_file_location("verl.remote_backend", {standin!r})
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    sys.modules["verl.remote_backend"] = sys.modules["verl.remote_backend.base"] = standin

    import verl  # imports the plugin named by VERL_USE_EXTERNAL_MODULES
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    heavy = {heavy!r}
    registry = standin.RemoteBackendRegistry
    out = {{
        "backends": registry.list(),
        "backend": registry.get("arctic").__qualname__,
        "replica_registered": "arctic" in RolloutReplicaRegistry._registry,
        "resolved_before": sorted(registry._resolved_workers),
        "loaded_at_import": [m for m in heavy if m in sys.modules],
    }}
    worker = registry.get_worker("arctic")
    out["worker"] = worker.__qualname__
    out["worker_cached"] = registry.get_worker("arctic") is worker
    out["loaded_after_worker"] = [m for m in heavy if m in sys.modules]
    out["replica"] = RolloutReplicaRegistry.get("arctic").__qualname__
    print(json.dumps(out))
    """
)


def test_env_var_registers_both_names_and_defers_heavy_imports():
    env = {
        **os.environ,
        "VERL_USE_EXTERNAL_MODULES": ENTRY,
        "VERL_USE_EXTERNAL_PLUGINS": "none",
        "HF_HUB_OFFLINE": "1",
    }
    code = SCRIPT.format(standin=str(STANDIN_PATH), heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backends"] == ["arctic"]
    assert out["backend"] == "ArcticRLClientWrapper"
    assert out["replica_registered"]
    assert out["resolved_before"] == []  # the worker loader had not run
    assert out["loaded_at_import"] == []
    assert out["worker"] == "ArcticRLActorRolloutRefWorker"
    assert out["worker_cached"]
    assert out["loaded_after_worker"] == ["arctic_platform.integrations.verl.worker"]
    assert out["replica"] == "ArcticRolloutReplica"


def test_without_remote_backend_the_error_names_the_verl_that_has_it(remote_backend, monkeypatch):
    import verl

    ours = [f"arctic_platform.integrations.verl.{m}" for m in ("register", "adapter")]
    for name in ours:
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in STANDIN_NAMES:  # None: absent even on a verl that ships the module
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError) as caught:
        importlib.import_module(ENTRY)
    message = str(caught.value)
    assert "verl.remote_backend" in message
    assert "#6422" in message and "#7102" in message
    assert verl.__version__ in message  # says which verl is installed


def test_loaders_resolve_our_classes(fresh_registry, remote_backend):
    from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper
    from arctic_platform.integrations.verl.rollout import ArcticRolloutReplica
    from arctic_platform.integrations.verl.worker import ArcticRLActorRolloutRefWorker

    registry = remote_backend.RemoteBackendRegistry
    assert registry.get("arctic") is ArcticRLClientWrapper
    assert issubclass(ArcticRLClientWrapper, remote_backend.RemoteBackend)
    assert not ArcticRLClientWrapper.__abstractmethods__
    assert registry.get_worker("arctic") is ArcticRLActorRolloutRefWorker
    replica = RolloutReplicaRegistry.get("arctic")
    assert replica is ArcticRolloutReplica and issubclass(replica, RolloutReplica)
    # verl's own rollouts stay registered beside ours.
    assert {"vllm", "sglang", "arctic"} <= set(RolloutReplicaRegistry._registry)


def test_registering_again_is_a_no_op_and_a_clash_raises(fresh_registry, remote_backend):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    registry = remote_backend.RemoteBackendRegistry
    registry.register("arctic")(ArcticRLClientWrapper)  # the same class and loader: accepted
    registry.register_worker("arctic", fresh_registry.load_worker)
    assert registry.list() == ["arctic"]

    class Other(remote_backend.RemoteBackend):
        pass

    with pytest.raises(ValueError, match="already registered"):
        registry.register("arctic")(Other)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_worker("arctic", lambda: Other)
    with pytest.raises(KeyError, match="Unknown remote backend 'nope'"):
        registry.get("nope")
