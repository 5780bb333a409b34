"""The GPU example launchers compose into a verl config the adapter accepts.

They cannot run here (no GPU, no verl with ``verl.remote_backend``), but their Hydra overrides
can be checked: each script runs with a ``python3`` on ``PATH`` that only prints the arguments it
was given; those overrides are composed against verl's own ``ppo_trainer`` config and go through
the adapter's config checks and client-config mapping.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from importlib.resources import files

import pytest

EXAMPLES = files("arctic_platform.integrations.verl").joinpath("examples")
# Prints what the launcher hands python3: the plugin variable it exported, then its arguments.
# The launcher's own form detection (hydra_group) runs for real.
PRINT_ARGS = """#!/bin/sh
if [ "$2" = "arctic_platform.integrations.verl.hydra_group" ]; then exec {python} "$@"; fi
exec {python} -c 'import json, os, sys
print(json.dumps([os.environ.get("VERL_USE_EXTERNAL_MODULES"), *sys.argv[1:]]))' "$@"
"""


def launcher_arguments(script: str, tmp_path) -> list[str]:
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(PRINT_ARGS.format(python=sys.executable))
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {
        **os.environ,
        "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
        "DATA_DIR": str(tmp_path / "data"),
        "BIRD_REWARD": str(tmp_path / "bird_reward.py"),
    }
    done = subprocess.run(
        ["bash", str(EXAMPLES.joinpath(script))],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("script", ["run_gsm8k_grpo_arl.sh", "run_bird_grpo_arl.sh"])
def test_example_overrides_give_a_config_the_adapter_accepts(script, compose_verl, tmp_path):
    from arctic_platform.integrations.verl.hydra_group import group_forms
    from arctic_platform.integrations.verl.verl_config import (
        check_verl_config,
        client_config,
        read_settings,
    )

    plugin, *args = launcher_arguments(script, tmp_path)
    assert plugin == "arctic_platform.integrations.verl.register"
    assert args[:2] == ["-m", "verl.trainer.main_ppo"]
    overrides = args[2:]
    assert group_forms().command_line in overrides  # the form this verl takes
    config = compose_verl(*overrides, arctic=False)
    check_verl_config(config)
    client = client_config(config, read_settings(config))
    assert client.backend.type == "http" and client.backend.launch_local_server
    assert client.backend.device == "cuda"
    assert client.model == "Qwen/Qwen3-0.6B"
    assert client.training.max_seq_len == (
        config.data.max_prompt_length + config.data.max_response_length
    )


def test_the_readmes_hydra_file_example_composes(remote_backend, tmp_path):
    """The config-file example of the integration's README, composed as the README says."""
    from hydra import compose, initialize_config_dir

    from arctic_platform.integrations.verl.verl_config import (
        check_verl_config,
        client_config,
        read_settings,
    )

    readme = files("arctic_platform.integrations.verl").joinpath("README.md").read_text()
    example = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_grpo.yaml").write_text(example)
    search_path = [
        "pkg://arctic_platform.integrations.verl.config",
        "pkg://verl.trainer.config",
    ]
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        config = compose("my_grpo", overrides=[f"hydra.searchpath=[{','.join(search_path)}]"])
    check_verl_config(config)
    client = client_config(config, read_settings(config))
    assert (client.backend.type, client.training.n_gpus) == ("ray", 4)
    specs = client.create_job_body()["sub_job_configs"]
    (training,) = [s["training_config"] for s in specs if s["job_type"] == "training"]
    assert training["n_gpus"] == 4  # four data-parallel Ray workers
    assert client.model == "Qwen/Qwen3-8B"


def test_the_readmes_cpu_smoke_command_composes(compose_verl):
    """The CPU smoke run of the integration's README: every override exists in verl's config."""
    import shlex

    from arctic_platform.integrations.verl.hydra_group import group_forms
    from arctic_platform.integrations.verl.verl_config import check_verl_config, read_settings

    readme = files("arctic_platform.integrations.verl").joinpath("README.md").read_text()
    block = readme.split("## A CPU smoke run", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    command = block.split("python -m verl.trainer.main_ppo", 1)[1].replace("\\\n", " ")
    select = "$(python -m arctic_platform.integrations.verl.hydra_group)"
    assert select in command
    command = command.replace(f'"{select}"', group_forms().command_line)
    overrides = shlex.split(command)
    config = compose_verl(*overrides, arctic=False)
    check_verl_config(config)
    assert config.ray_kwargs.ray_init.num_cpus == 16
    assert config.transfer_queue.backend.SimpleStorage.num_data_storage_units == 1
    assert read_settings(config).backend == "inprocess"
