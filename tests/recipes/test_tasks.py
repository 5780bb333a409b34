"""Tasks: data, held-out splits and rewards."""

from __future__ import annotations

import json

import pytest

from arctic_platform.recipes.tasks import Example, build_task
from arctic_platform.recipes.tasks.addition import AdditionTask
from arctic_platform.recipes.tasks.gsm8k import INSTRUCTION, Gsm8kTask, extract_answer


def test_addition_holds_out_its_eval_pairs_and_is_deterministic():
    task = AdditionTask(max_operand=20, eval_size=50, seed=3)
    held_out = {e.prompt for e in task.eval_set()}
    assert len(held_out) == 50
    seen = {e.prompt for step in range(200) for e in task.train_batch(step, 32)}
    assert not held_out & seen
    assert task.train_batch(7, 5) == AdditionTask(max_operand=20, eval_size=50, seed=3).train_batch(
        7, 5
    )
    assert task.train_batch(7, 5) != task.train_batch(8, 5)
    example = Example("12+30=", "42")
    assert task.reward("42", example) == 1.0
    assert task.reward(" 42\n", example) == 1.0
    assert task.reward("420", example) == 0.0
    assert task.sft_completion(example) == "42"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_operand": 0}, "max_operand"),
        ({"eval_size": 0}, "eval_size"),
        ({"max_operand": 2, "eval_size": 9}, "eval_size"),
    ],
)
def test_addition_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        AdditionTask(**options)


def test_unknown_task_names_are_errors():
    with pytest.raises(ValueError, match="task.name: unknown task 'sorting'"):
        build_task("sorting")


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("so #### 42", "42"),
        ("#### 1 then #### 2", "2"),  # the last match counts
        ("#### 1,234", "1234"),
        ("#### -7", "-7"),
        ("no marker 42", None),
        ("#### 5" + "x" * 400, None),  # only the last 300 characters are read
        ("#### $12", None),  # the number must follow "#### " directly
    ],
)
def test_gsm8k_answer_extraction_follows_verl(completion, answer):
    assert extract_answer(completion) == answer


def write_gsm8k_files(tmp_path):
    rows = [
        {"question": "Ann has 2 apples and buys 3. How many?", "answer": "2+3=5\n#### 5"},
        {"question": "Bob has 1,000 coins and spends 1. How many?", "answer": "#### 999"},
    ]
    jsonl = tmp_path / "test.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    verl_rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": extract_answer(r["answer"])},
        }
        for r in rows
    ]
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows), parquet)
    return parquet, jsonl


def test_gsm8k_reads_verl_parquet_and_original_jsonl(tmp_path):
    parquet, jsonl = write_gsm8k_files(tmp_path)
    task = Gsm8kTask(train_path=str(parquet), eval_path=str(jsonl), eval_size=10)
    assert [e.answer for e in task.eval_set()] == ["5", "999"]
    assert task.eval_set()[0].prompt.endswith(INSTRUCTION)
    assert {e.answer for e in task.train_batch(0, 20)} == {"5", "999"}
    example = task.eval_set()[1]
    assert task.reward("1000 - 1 = 999\n#### 999", example) == 1.0
    assert task.reward("#### 998", example) == 0.0
    assert task.sft_completion(example) == "#### 999"


def test_gsm8k_bad_files_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Gsm8kTask(train_path=str(tmp_path / "nope.jsonl"), eval_path=str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="line 1: answer has no"):
        Gsm8kTask(train_path=str(bad), eval_path=str(bad))
    bad.write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(ValueError, match="expected an object with question and answer"):
        Gsm8kTask(train_path=str(bad), eval_path=str(bad))


def test_the_gsm8k_recipe_loads_with_local_data_paths(tmp_path):
    from importlib import resources

    from arctic_platform.recipes.config import load_recipe
    from arctic_platform.recipes.tasks import build_task

    parquet, jsonl = write_gsm8k_files(tmp_path)
    path = resources.files("arctic_platform.recipes") / "gsm8k_grpo.yaml"
    recipe = load_recipe(str(path), [f"task.train_path={parquet}", f"task.eval_path={jsonl}"])
    assert recipe.client.model == "Qwen/Qwen3-0.6B" and recipe.task.chat_template
    task = build_task(recipe.task.name, **recipe.task.options())
    assert len(task.eval_set()) == 2
