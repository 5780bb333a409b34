"""Fixtures for the verl integration: real verl 0.9.1, plus a stand-in for ``verl.remote_backend``.

Only ``verl.remote_backend`` is a stand-in (:mod:`.remote_backend_standin`, named as such): no
verl release has it yet. ``DataProto``, ``core_algos``, the rollout replica registry, the padding
helpers, the trainer's own driver methods and the Hydra configs are verl's. Without verl installed
(the ``verl`` extra) these tests are not collected.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

if importlib.util.find_spec("verl") is None:
    collect_ignore_glob = ["test_*.py"]

STANDIN_PATH = Path(__file__).with_name("remote_backend_standin.py")
STANDIN_NAMES = ("verl.remote_backend", "verl.remote_backend.base")
SEARCH_PATH = "hydra.searchpath=[pkg://arctic_platform.integrations.verl.config]"
TINY = "builtin:tiny"
# A small GRPO run on the built-in tiny model: 2 prompts x 4 samples, 2 mini-batches per step.
TINY_OVERRIDES = (
    f"actor_rollout_ref.model.path={TINY}",
    "actor_rollout_ref.rollout.name=arctic",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.temperature=0.8",
    "data.train_batch_size=2",
    "data.max_prompt_length=8",
    "data.max_response_length=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.optim.lr=0.003",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "trainer.n_gpus_per_node=1",
    "algorithm.adv_estimator=grpo",
)


def load_standin() -> ModuleType:
    """A fresh copy of the stand-in module, named ``verl.remote_backend``."""
    spec = importlib.util.spec_from_file_location(STANDIN_NAMES[0], STANDIN_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def remote_backend() -> Iterator[ModuleType]:
    """The stand-in installed as ``verl.remote_backend`` for the session, the plugin registered."""
    import verl  # noqa: F401  (the real package first, so the stand-in sits beside it)

    module = load_standin()
    saved = {name: sys.modules.get(name) for name in STANDIN_NAMES}
    for name in STANDIN_NAMES:
        sys.modules[name] = module
    importlib.import_module("arctic_platform.integrations.verl.register")
    yield module
    for name, previous in saved.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous


@pytest.fixture
def fresh_registry(remote_backend, monkeypatch) -> ModuleType:
    """Empty registries, then the plugin registered again into them; restored afterwards."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    registry = remote_backend.RemoteBackendRegistry
    for attr in ("_backends", "_worker_loaders", "_resolved_workers"):
        monkeypatch.setattr(registry, attr, {})
    monkeypatch.setattr(RolloutReplicaRegistry, "_registry", dict(RolloutReplicaRegistry._registry))
    register = importlib.reload(sys.modules["arctic_platform.integrations.verl.register"])
    return register


def install_standin() -> ModuleType:
    """Put a fresh stand-in in ``sys.modules`` and register the plugin (for scripts; tests use
    the ``remote_backend`` fixture, which also restores ``sys.modules``)."""
    import verl  # noqa: F401

    module = load_standin()
    for name in STANDIN_NAMES:
        sys.modules[name] = module
    importlib.import_module("arctic_platform.integrations.verl.register")
    return module


def compose_config(*overrides: str, arctic: bool = True, config_dir: Path | None = None):
    """verl's ``ppo_trainer`` config (from ``config_dir``, default the installed verl's) through
    Hydra, with ``overrides``.

    With ``arctic`` the ``remote_backend=arctic`` group is selected in the form that verl takes
    (:mod:`arctic_platform.integrations.verl.hydra_group`: ``+`` where the defaults list has no
    such group, as in verl 0.9.1) from our package's config folder, plus the tiny-model overrides.
    """
    from hydra import compose, initialize_config_dir

    from arctic_platform.integrations.verl.hydra_group import group_forms, verl_config_dir

    config_dir = config_dir or verl_config_dir()
    select = group_forms(config_dir).command_line
    chosen = [*TINY_OVERRIDES, select, SEARCH_PATH] if arctic else []
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=[*chosen, *overrides])


def config_dir_with_group(folder: Path) -> Path:
    """STAND-IN for the trainer configs of a verl with PR #7102: the installed verl's configs
    with the one defaults entry that PR adds (``optional remote_backend@remote_backend: null``,
    before ``legacy_reward_impl``, as there)."""
    import shutil

    from arctic_platform.integrations.verl.hydra_group import verl_config_dir

    target = folder / "verl_config_with_remote_backend_group"
    shutil.copytree(verl_config_dir(), target)
    trainer = target / "ppo_trainer.yaml"
    text = trainer.read_text()
    anchor = "  - legacy_reward_impl\n"
    assert anchor in text, "verl's ppo_trainer.yaml changed: update the stand-in"
    trainer.write_text(
        text.replace(anchor, "  - optional remote_backend@remote_backend: null\n" + anchor, 1)
    )
    return target


@pytest.fixture(scope="session")
def compose_verl(remote_backend) -> Callable[..., object]:
    """:func:`compose_config`, with the stand-in installed."""
    return compose_config


def inprocess_overrides(data_dir: Path) -> tuple[str, ...]:
    """Overrides that run the engines in this process, on the CPU, keeping data in ``data_dir``."""
    return (
        "remote_backend.arctic.backend=inprocess",
        f"remote_backend.arctic.inprocess.data_dir={data_dir}",
        "remote_backend.arctic.inprocess.device=cpu",
    )


@pytest.fixture(scope="module")
def worker_env() -> Iterator[None]:
    """The environment verl's Ray launcher gives a worker of a one-process group."""
    from verl.utils.device import get_visible_devices_keyword

    keys = (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "REDIS_STORE_SERVER_HOST",
        get_visible_devices_keyword().upper(),
    )
    with pytest.MonkeyPatch.context() as patch:
        for key in keys:
            patch.delenv(key, raising=False)
        values = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
        for key, value in values.items():
            patch.setenv(key, value)
        yield
