"""The main job with ``sampling.engine=vllm`` and nothing else set: README's command.

First the README's configuration as it is (the default recipe's client with ``--set
sampling.engine=vllm``, no memory knob): the job starts on a machine with other work running
(vLLM's KV cache is sized from the job, not 92% of the machine), one GRPO-shaped generate and a
weight sync run (by ``reload``, what ``auto`` is on CPU), and the idle vLLM process then uses no
measurable CPU.

That the main job learns with this override is ``tests/recipes/test_learning.py`` (it shares
the default sampler's warm-up).
"""

from __future__ import annotations

import time

import pytest

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.recipes.config import load_recipe
from tests.vllm.conftest import cpu_seconds, needs_vllm
from tests.vllm.test_cpu_memory import tiny_kv_bytes_per_token

pytestmark = [needs_vllm, pytest.mark.slow]

README_OVERRIDE = "sampling.engine=vllm"
IDLE_WINDOW_S = 3.0
IDLE_CORE_SHARE = 0.05  # of one core: an idle process's housekeeping, far below a spinning one


def test_the_readme_configuration_starts_samples_syncs_and_idles(tmp_path):
    recipe = load_recipe(None, [README_OVERRIDE])
    sampling = recipe.client.sampling
    assert sampling.engine == "vllm" and sampling.vllm == {}  # nothing else set
    backend = recipe.client.backend.model_copy(update={"data_dir": tmp_path / "data"})
    config = recipe.client.model_copy(update={"seed": recipe.seed, "backend": backend})
    client = create_arctic_rl_client(config, blocking_calls=True)
    try:
        engine = client.get_server_state().resolve(client.sampling_job_id, owner=None).engine
        # The job's own need: its default 256 sequences of the tiny model's 1024 positions.
        assert engine.info["kv_cache_bytes"] == 256 * 1024 * tiny_kv_bytes_per_token()
        assert engine.info["kv_cache_source"].startswith("the job")

        grpo = recipe.grpo
        params = {"n": grpo.samples_per_prompt, "temperature": grpo.temperature}
        params.update(max_tokens=grpo.max_tokens, seed=0)
        prompts = [[40 + i % 20, 41, 42] for i in range(grpo.prompts_per_step)]
        samples = client.generate(prompt_ids=prompts, sampling_params=params)
        assert len(samples) == grpo.prompts_per_step * grpo.samples_per_prompt
        synced = client.sync_weights()["targets"][0]
        assert synced["method"] == "reload" and synced["complete"]
        assert client.generate(prompt_ids=prompts[:1], sampling_params=params)

        before = cpu_seconds(engine.pid)
        time.sleep(IDLE_WINDOW_S)
        used = cpu_seconds(engine.pid) - before
        assert used < IDLE_CORE_SHARE * IDLE_WINDOW_S, (
            f"the idle vLLM process used {used:.2f} s of CPU in {IDLE_WINDOW_S} s"
        )
    finally:
        client.shutdown()
