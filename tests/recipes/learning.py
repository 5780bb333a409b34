"""The bars a CI-sized default run (the whole warm-up, then 60 GRPO steps) must clear.

Where the warm-up ends is chaotic: the loss sits on a plateau near 0.8 and breaks through it at a
step that moves with the float rounding, which the memory layout a BLAS call meets changes (the
same settings with evaluations every 30 steps instead of none ended at 0.83 and 0.955 held-out
where they had ended at 0.80 and 0.57). So the bars are what held over every run measured
(``benchmarks/results/warmup_sweep.json``: 900 warm-up steps always broke through, ending at
0.57-0.985), not one run's figures; and GRPO's part is judged by what it optimises, the reward of
its own samples, and by keeping the held-out accuracy the warm-up reached (60 steps at the default
rate measured 0.83 -> 0.875 held-out, sample reward 0.59 -> 0.65).
"""

from __future__ import annotations

from statistics import mean

from arctic_platform.recipes.grpo import RunSummary

WARM_UP_FLOOR = 0.5
HELD_OUT_SLACK = 0.03  # a few of the 200 held-out sums: greedy answers near a tie flip


def assert_the_run_learns(summary: RunSummary) -> None:
    """The warm-up broke through its plateau, GRPO raised its sample reward, and held-out
    accuracy stayed where the warm-up left it or rose."""
    warm_up, grpo = summary.eval_rewards("sft"), summary.eval_rewards("grpo")
    assert warm_up[-1] >= WARM_UP_FLOOR, warm_up
    rewards = [r["reward_mean"] for r in summary.records if r["phase"] == "grpo"]
    assert mean(rewards[-10:]) > mean(rewards[:10]), rewards
    assert grpo[-1] >= warm_up[-1] - HELD_OUT_SLACK, (warm_up[-1], grpo)
