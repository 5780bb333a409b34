"""The main job's GRPO phase with ``sampling.engine=vllm`` learns like the default.

The same CI-sized default recipe as ``tests/recipes/test_recipe_run.py`` (SFT warm-up, then 60
GRPO steps), with the sampler switched to vLLM from the command line's ``--set`` form: rollouts,
held-out evaluation and the weight sync after every step go through the vLLM engine, and the run
must clear the same bars as the default run (the warm-up works, GRPO then raises held-out reward).
Weights reach vLLM by ``reload`` (tested against a fresh engine in ``test_weight_sync.py``), which
keeps the 60 syncs cheap.
"""

from __future__ import annotations

import pytest

from arctic_platform.recipes.config import load_recipe
from arctic_platform.recipes.grpo import run_recipe
from tests.vllm.conftest import VLLM_ENV, needs_vllm

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.mark.timeout(1800)  # the SFT warm-up alone is most of the default run's minutes
def test_grpo_with_the_vllm_sampler_learns(tmp_path):
    overrides = [
        "grpo.steps=60",
        "eval.every=30",
        "checkpoint.every=0",
        "sampling.engine=vllm",
        "sampling.vllm.weight_sync=reload",
        f"sampling.vllm.env={VLLM_ENV}",
    ]
    recipe = load_recipe(None, overrides)
    assert recipe.client.sampling.engine == "vllm"
    summary = run_recipe(recipe, tmp_path / "run", show_progress=False)
    sft = summary.eval_rewards("sft")
    grpo_evals = summary.eval_rewards("grpo")
    assert sft[-1] >= 0.3
    assert grpo_evals[-1] >= sft[-1] + 0.1
