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
    """The task called ``name`` with its options (from the recipe's ``task`` section), checked
    against its constructor first: an option it does not take, or of the wrong type, is a
    ``ValueError`` naming ``task.<option>``."""
    from arctic_platform.recipes.tasks.addition import AdditionTask
    from arctic_platform.recipes.tasks.gsm8k import Gsm8kTask

    tasks = {"addition": AdditionTask, "gsm8k": Gsm8kTask}
    if name not in tasks:
        raise ValueError(f"task.name: unknown task {name!r}; known: {sorted(tasks)}")
    return tasks[name](**_checked_options(name, tasks[name], options))


def _checked_options(name: str, task: type, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` validated against ``task``'s keyword arguments (their types and defaults,
    read from its constructor: the one definition of a task's options)."""
    import inspect
    import typing

    from pydantic import ConfigDict, ValidationError, create_model

    hints = typing.get_type_hints(task.__init__)
    fields = {
        arg: (hints[arg], ... if param.default is param.empty else param.default)
        for arg, param in inspect.signature(task.__init__).parameters.items()
        if param.kind is param.KEYWORD_ONLY
    }
    model = create_model(f"{task.__name__}Options", __config__=ConfigDict(extra="forbid"), **fields)
    try:
        return model.model_validate(options).model_dump()
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            raise ValueError(
                f"task.{where}: not an option of the {name} task; its options: {sorted(fields)}"
            ) from None
        raise ValueError(f"task.{where}: {error['msg']}") from None
