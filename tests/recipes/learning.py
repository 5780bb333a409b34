"""The bars a CI-sized default run (the whole warm-up, then 60 GRPO steps) must clear.

Where the warm-up ends is chaotic: its loss sits on a plateau near 0.8 and breaks through at a
step that moves with the float rounding (the chunked LM head, a 5% change of rate, or other work
in the process change it). So the bars are what held over every run measured
(``benchmarks/results/warmup_sweep.json``), not one run's figures. Sixty GRPO steps are too few to
show GRPO's gain: its first updates move the policy off the warm-up's greedy answers (the default
run fell from 0.84 to 0.655 held-out 25 steps in, then rose to 0.88 after 200, README's table),
so here GRPO must only keep the policy working; what it gains is measured on the full run.
"""

from __future__ import annotations

from arctic_platform.recipes.grpo import RunSummary

WARM_UP_FLOOR = 0.5
AFTER_GRPO_FLOOR = 0.5


def assert_the_run_learns(summary: RunSummary) -> None:
    """The warm-up broke through its plateau, and GRPO's updates kept the policy answering."""
    warm_up, grpo = summary.eval_rewards("sft"), summary.eval_rewards("grpo")
    assert warm_up[-1] >= WARM_UP_FLOOR, warm_up
    assert min(grpo) >= AFTER_GRPO_FLOOR, grpo
