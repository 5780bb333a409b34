"""``remote_backend=arctic`` in the form the verl in use takes: verl 0.9.1 (no group in the
trainer's defaults list: ``+``) and a STAND-IN for a verl with PR #7102's group (``override``).

The stand-in (``config_dir_with_group``) is verl's own configs plus the one defaults entry the PR
adds, so Hydra itself decides which spelling works.
"""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from arctic_platform.integrations.verl.hydra_group import group_forms, verl_config_dir
from tests.integrations.verl.conftest import (
    SEARCH_PATH,
    TINY_OVERRIDES,
    compose_config,
    config_dir_with_group,
)


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    return {
        "verl": verl_config_dir(),
        "with_group": config_dir_with_group(tmp_path_factory.mktemp("verl")),
    }


def test_the_form_follows_the_defaults_list(config_dirs):
    assert group_forms(config_dirs["verl"]).command_line == "+remote_backend=arctic"
    assert group_forms(config_dirs["verl"]).defaults_entry == "remote_backend: arctic"
    assert group_forms(config_dirs["with_group"]).command_line == "remote_backend=arctic"
    assert (
        group_forms(config_dirs["with_group"]).defaults_entry == "override remote_backend: arctic"
    )


def test_both_verls_compose_the_same_arctic_settings(compose_verl, config_dirs):
    composed = {
        name: compose_config("remote_backend.arctic.training.n_gpus=2", config_dir=path)
        for name, path in config_dirs.items()
    }
    assert composed["verl"].remote_backend == composed["with_group"].remote_backend
    assert composed["with_group"].remote_backend.arctic.training.n_gpus == 2


def test_the_other_form_fails_on_each_verl(compose_verl, config_dirs):
    """What the detection avoids: Hydra refuses the wrong spelling."""
    from hydra import compose, initialize_config_dir

    for name, wrong in (
        ("verl", "remote_backend=arctic"),
        ("with_group", "+remote_backend=arctic"),
    ):
        refused = pytest.raises(ConfigCompositionException)
        with initialize_config_dir(config_dir=str(config_dirs[name]), version_base=None), refused:
            compose("ppo_trainer", overrides=[*TINY_OVERRIDES, wrong, SEARCH_PATH])


def test_the_readme_config_file_form_composes_on_both(compose_verl, config_dirs, tmp_path):
    from hydra import compose, initialize_config_dir

    for name, path in config_dirs.items():
        own = tmp_path / name
        own.mkdir()
        entry = group_forms(path).defaults_entry
        (own / "my_grpo.yaml").write_text(
            "defaults:\n  - ppo_trainer\n"
            f"  - {entry}\n  - _self_\n"
            "remote_backend:\n  arctic:\n    backend: inprocess\n"
        )
        search = f"hydra.searchpath=[pkg://arctic_platform.integrations.verl.config,file://{path}]"
        with initialize_config_dir(config_dir=str(own), version_base=None):
            config = compose("my_grpo", overrides=[search])
        assert config.remote_backend.arctic.backend == "inprocess", name
