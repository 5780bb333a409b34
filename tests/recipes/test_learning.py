"""The default run learns, with the default sampler and with vLLM's: one warm-up, two GRPO runs.

The SFT warm-up is most of a CI-sized default run's minutes, and it is the same whichever sampler
the run uses (the trainer does it; the sampler only evaluates). So this module runs it once, as
the default recipe with no GRPO steps (checkpointed at its last step, evaluated there), and each
test continues a copy of it with 60 GRPO steps through ``run_recipe(..., resume=True)``: the path
``arctic-platform train --resume`` takes, here at the phase boundary. The bars, and why they are
what they are: :mod:`tests.recipes.learning`.

vLLM's sampler rounds differently from ours, so its samples, and the updates they drive, are not
the default engine's: the bars hold over such differences.
"""

from __future__ import annotations

import json
import shutil

import pytest

from arctic_platform.recipes.config import load_recipe
from arctic_platform.recipes.grpo import run_recipe
from tests.recipes.learning import assert_the_run_learns
from tests.vllm.conftest import needs_vllm

pytestmark = pytest.mark.slow

GRPO = ["grpo.steps=60", "eval.every=30", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def warmed_up(tmp_path_factory):
    """A run directory holding the default recipe's whole warm-up, checkpointed at its end."""
    run_dir = tmp_path_factory.mktemp("warm-up") / "run"
    recipe = load_recipe(None, ["grpo.steps=0", "eval.every=0", "checkpoint.every=0"])
    run_recipe(recipe, run_dir, show_progress=False)
    return run_dir


def continue_with_grpo(warmed_up, run_dir, overrides: list[str] = ()):
    shutil.copytree(warmed_up, run_dir)
    recipe = load_recipe(None, GRPO + list(overrides))
    return recipe, run_recipe(recipe, run_dir, resume=True, show_progress=False)


def test_a_shortened_default_run_learns(warmed_up, tmp_path):
    """CI-sized default recipe: the warm-up teaches the format and most sums, and GRPO's
    updates keep the policy working."""
    recipe, summary = continue_with_grpo(warmed_up, tmp_path / "run")
    assert_the_run_learns(summary)
    lines = summary.metrics_path.read_text().splitlines()
    assert len(lines) == recipe.sft.steps + 60
    last = json.loads(lines[-1])
    for key in (
        "step",
        "phase",
        "reward_mean",
        "reward_std",
        "pass_rate",
        "loss",
        "grad_norm",
        "lr",
        "response_len_mean",
        "time_generate_s",
        "time_train_s",
        "eval_reward",
    ):
        assert key in last, key
    assert summary.plot_path.stat().st_size > 10_000


@needs_vllm
@pytest.mark.timeout(1800)
def test_grpo_with_the_vllm_sampler_learns(warmed_up, tmp_path):
    """README's ``--set sampling.engine=vllm`` and nothing else: rollouts, held-out evaluation
    and the weight sync after every GRPO step go through the vLLM engine."""
    recipe, summary = continue_with_grpo(warmed_up, tmp_path / "run", ["sampling.engine=vllm"])
    assert recipe.client.sampling.engine == "vllm"
    assert_the_run_learns(summary)
    grpo_evals = [r for r in summary.records if r.get("phase") == "grpo" and "eval_reward" in r]
    assert [r["step"] for r in grpo_evals] == [recipe.sft.steps + 29, recipe.sft.steps + 59]
