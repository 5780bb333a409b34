"""The bars a CI-sized default run (the whole warm-up, then 60 GRPO steps) must clear.

Where the warm-up ends is chaotic: its loss sits on a plateau near 0.8 and breaks through at a
step that moves with the float rounding (the chunked LM head, the thread count, the CPU's vector
width, a 5% change of rate). So the bars are what held over every run measured around the
defaults (``benchmarks/results/warmup_sweep.json``: 0.555 to 1.0 held-out for peak rates of 2e-3
to 2.4e-3 with AVX-512 and AVX2 kernels), not one run's figures. Sixty GRPO steps are too few to
show GRPO's gain: its first updates move the policy off the warm-up's greedy answers (held-out
reward can dip before it rises, README's caveat), so here GRPO must only keep the policy working;
what it gains is measured on the full run.
"""

from __future__ import annotations

from arctic_platform.recipes.grpo import RunSummary

FLOOR = 0.3  # held-out greedy reward; a policy that lost the format scores near 0


def assert_the_run_learns(summary: RunSummary) -> None:
    """The warm-up broke through its plateau, and GRPO's updates kept the policy answering."""
    warm_up, grpo = summary.eval_rewards("sft"), summary.eval_rewards("grpo")
    assert warm_up[-1] >= FLOOR, warm_up
    assert min(grpo) >= FLOOR, grpo
