"""Tasks: where prompts come from and how completions are scored.

A task is a plain object with ``train_batch``, ``eval_set``, ``reward`` and ``sft_completion``;
recipes pick one by name from :data:`TASKS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    """One prompt and what a perfect completion says."""

    prompt: str
    answer: str


class Task(Protocol):
    def train_batch(self, step: int, size: int) -> list[Example]:
        """``size`` training examples for ``step`` (deterministic given the task's seed)."""

    def eval_set(self) -> list[Example]:
        """The held-out examples scored greedily during evaluation."""

    def reward(self, completion: str, example: Example) -> float:
        """The score of ``completion`` for ``example`` (1.0 = correct)."""

    def sft_completion(self, example: Example) -> str:
        """The target text a supervised warm-up trains on."""


def build_task(name: str, **options: Any) -> Task:
    """The task called ``name`` with its options (from the recipe's ``task`` section)."""
    from arctic_platform.recipes.tasks.addition import AdditionTask
    from arctic_platform.recipes.tasks.gsm8k import Gsm8kTask

    tasks = {"addition": AdditionTask, "gsm8k": Gsm8kTask}
    if name not in tasks:
        raise ValueError(f"task.name: unknown task {name!r}; known: {sorted(tasks)}")
    return tasks[name](**options)
