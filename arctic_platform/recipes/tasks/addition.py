"""Two-digit addition: ``"37+58="`` -> ``"95"``, scored by exact match.

Small enough for a 1 M parameter model to learn on a CPU in minutes, hard enough that a short
supervised warm-up leaves room for GRPO to show real gains. The evaluation pairs are held out:
training never shows them.
"""

from __future__ import annotations

import random

from arctic_platform.recipes.tasks import Example

# The largest operand: every pair is listed (and shuffled) once, so (max_operand + 1)^2 of them.
MAX_OPERAND = 9999


class AdditionTask:
    """Sums of two numbers in ``[0, max_operand]``; ``eval_size`` pairs are held out."""

    def __init__(self, *, max_operand: int = 99, eval_size: int = 200, seed: int = 0) -> None:
        if not 1 <= max_operand <= MAX_OPERAND:
            raise ValueError(f"task.max_operand: must be in 1..{MAX_OPERAND}, got {max_operand}")
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        if not 0 < eval_size < len(pairs):
            raise ValueError(f"task.eval_size: must be in 1..{len(pairs) - 1}, got {eval_size}")
        random.Random(seed).shuffle(pairs)
        self._eval = [self._example(a, b) for a, b in pairs[:eval_size]]
        self._train = pairs[eval_size:]
        self._seed = seed

    @staticmethod
    def _example(a: int, b: int) -> Example:
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    def train_batch(self, step: int, size: int) -> list[Example]:
        rng = random.Random(f"{self._seed}:{step}")
        return [self._example(*rng.choice(self._train)) for _ in range(size)]

    def eval_set(self) -> list[Example]:
        return list(self._eval)

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if completion.strip() == example.answer else 0.0

    def sft_completion(self, example: Example) -> str:
        return example.answer
