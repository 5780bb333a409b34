"""GSM8K: grade-school math word problems, answer after ``####``.

Data is read from a local file — the parquet verl's ``gsm8k.py`` preprocessing writes (``prompt``
messages and ``reward_model.ground_truth``) or JSONL in the original ``{question, answer}`` form —
never downloaded. The reward follows verl's ``gsm8k.compute_score`` with its defaults: look at the
last 300 characters, take the last ``#### <number>``, drop ``,`` and ``$``, and score 1.0 on an
exact string match with the gold answer, else 0.0.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from arctic_platform._extras import require
from arctic_platform.recipes.tasks import Example

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GOLD = re.compile(r"#### (\-?[0-9\.\,]+)")
_CLIP_CHARS = 300


def extract_answer(text: str) -> str | None:
    """The last ``#### <number>`` in the last 300 characters, without ``,`` and ``$``."""
    matches = _GOLD.findall(text[-_CLIP_CHARS:])
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


def load_examples(path: str | Path) -> list[Example]:
    """Examples from a verl-style parquet file or an original-format JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task.train_path/eval_path: {path} does not exist")
    if path.suffix == ".parquet":
        pq = require("pyarrow.parquet", "recipes", purpose="reading parquet data")

        rows = pq.read_table(path).to_pylist()
        return [_from_verl_row(row, path, i) for i, row in enumerate(rows)]
    examples = []
    with path.open() as handle:
        for i, line in enumerate(handle):
            if line.strip():
                examples.append(_from_original_row(json.loads(line), path, i))
    return examples


def _from_verl_row(row: dict, path: Path, index: int) -> Example:
    try:
        prompt = row["prompt"][-1]["content"]
        answer = str(row["reward_model"]["ground_truth"])
    except (KeyError, IndexError, TypeError):
        raise ValueError(
            f"{path} row {index}: expected verl columns prompt[-1].content and "
            "reward_model.ground_truth"
        ) from None
    return Example(prompt=prompt, answer=answer)


def _from_original_row(row: dict, path: Path, index: int) -> Example:
    if not isinstance(row, dict) or "question" not in row or "answer" not in row:
        raise ValueError(f"{path} line {index + 1}: expected an object with question and answer")
    gold = extract_answer(row["answer"])
    if gold is None:
        raise ValueError(f"{path} line {index + 1}: answer has no '#### <number>'")
    return Example(prompt=f"{row['question']} {INSTRUCTION}", answer=gold)


class Gsm8kTask:
    """GSM8K prompts from ``train_path``, evaluation on ``eval_path`` (first ``eval_size`` rows)."""

    def __init__(
        self, *, train_path: str, eval_path: str, eval_size: int = 256, seed: int = 0
    ) -> None:
        self._train = load_examples(train_path)
        self._eval = load_examples(eval_path)[:eval_size]
        if not self._train or not self._eval:
            raise ValueError("task.train_path/eval_path: no examples found")
        self._seed = seed

    def train_batch(self, step: int, size: int) -> list[Example]:
        rng = random.Random(f"{self._seed}:{step}")
        return [rng.choice(self._train) for _ in range(size)]

    def eval_set(self) -> list[Example]:
        return list(self._eval)

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if extract_answer(completion) == example.answer else 0.0

    def sft_completion(self, example: Example) -> str:
        return f"#### {example.answer}"
