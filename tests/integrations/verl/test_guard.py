"""Guardrail G1: with the plugin loaded, a verl config that chooses no remote backend never touches
the registry, so a default verl run takes exactly the path it takes without arctic-platform."""

from __future__ import annotations

import pytest

from tests.integrations.verl.conftest import inprocess_overrides


@pytest.fixture
def registry_calls(fresh_registry, remote_backend, monkeypatch) -> list[tuple]:
    """Every call to the registry's ``create``, ``get`` and ``get_worker``, recorded."""
    registry = remote_backend.RemoteBackendRegistry
    calls: list[tuple] = []
    for name in ("create", "get", "get_worker"):
        original = getattr(registry, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, *args))
            return _original(*args, **kwargs)

        monkeypatch.setattr(registry, name, recording)
    return calls


def test_default_config_never_touches_the_registry(registry_calls, compose_verl, worker_env):
    from verl.workers.rollout.replica import RolloutReplicaRegistry, _load_vllm

    from arctic_platform.integrations.verl.rollout import ArcticTokenServer
    from arctic_platform.integrations.verl.selection import backend_for, remote_backend_name
    from arctic_platform.integrations.verl.worker import ArcticRLActorRolloutRefWorker

    default = compose_verl(arctic=False)  # verl's own ppo_trainer.yaml: nothing chosen
    assert remote_backend_name(default) is None
    assert backend_for(default) is None
    # verl's default rollout still resolves to verl's own loader.
    assert RolloutReplicaRegistry._registry["vllm"] is _load_vllm
    # Our verl-side parts refuse a config that did not choose them, without a registry lookup.
    with pytest.raises(ValueError, match="chooses no remote backend"):
        ArcticRLActorRolloutRefWorker(
            default.actor_rollout_ref, "actor_rollout_ref", main_config=default, backend_handle={}
        )
    with pytest.raises(ValueError, match="needs the arctic remote backend chosen"):
        ArcticTokenServer(
            default, {}, response_length=4, max_model_len=None, free_cache_engine=True
        )
    assert registry_calls == []


def test_choosing_arctic_goes_through_the_registry(registry_calls, compose_verl, tmp_path):
    """The positive control: the same path with ``remote_backend=arctic`` looks the backend up."""
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper
    from arctic_platform.integrations.verl.selection import backend_for, remote_backend_name

    chosen = compose_verl(*inprocess_overrides(tmp_path))
    assert remote_backend_name(chosen) == "arctic"
    backend = backend_for(chosen)
    try:
        assert isinstance(backend, ArcticRLClientWrapper)
        assert registry_calls == [("get", "arctic")]
    finally:
        backend.destroy()
