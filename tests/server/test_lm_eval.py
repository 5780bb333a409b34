"""lm-eval, unmodified, evaluates a checkpoint of a run through the OpenAI-compatible API.

The main job (``run_recipe``, shortened: its warm-up and two GRPO steps, on chat-rendered prompts)
trains ``builtin:tiny`` on a server and saves its checkpoint; lm-eval's own CLI then evaluates
``job:<id>/<checkpoint>`` on two tasks defined locally (task YAMLs over a JSONL of held-out sums,
no hub), and a second job of our client restores the same checkpoint to answer independently:

* a generation task with ``local-chat-completions`` (greedy, the model's chat template): its
  answers, and so its exact-match score, are our client's greedy ``generate`` on the same items;
* a log-likelihood task with ``local-completions`` (``echo`` + ``logprobs``): each item's
  log-likelihood is our ``fwd_no_grad`` log-probs of the answer, summed, to 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.engine.builtin import builtin_model_path
from arctic_platform.layout import training_batch
from arctic_platform.recipes.config import load_recipe
from arctic_platform.recipes.grpo import STATE_FILE, run_recipe
from arctic_platform.recipes.launch import backend_settings
from arctic_platform.recipes.tasks.addition import AdditionTask
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import TINY, make_app

pytest.importorskip("lm_eval", reason="lm-eval (dev extra) is not installed")
pytestmark = pytest.mark.slow

ITEMS = 24
# The main job (``arctic-platform train``), shortened: its warm-up, two GRPO steps and the final
# checkpoint; prompts rendered with the chat template, as local-chat-completions renders them.
RUN = [
    "task.chat_template=true",
    "sft.steps=40",
    "grpo.steps=2",
    "grpo.prompts_per_step=4",
    "eval.every=0",
    "eval.size=20",
    "checkpoint.every=0",
    "logging.plot_every=0",
]
MAX_TOKENS = 5
STOP = "\n"


def task_yaml(name: str, data: Path, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n" + body
    )


GENERATE = f"""output_type: generate_until
generation_kwargs:
  until: [{json.dumps(STOP)}]
  max_gen_toks: {MAX_TOKENS}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
LOGLIKELIHOOD = """output_type: loglikelihood
target_delimiter: ''
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A server, the main job shortened on it (its checkpoint the model lm-eval evaluates), and a
    client whose job restored that checkpoint the way a resumed run does."""
    root = tmp_path_factory.mktemp("lm-eval")
    service = Service(ServiceSettings(data_dir=root / "server", device="cpu"))
    with serve_app(make_app(service)) as url:
        recipe = load_recipe(None, RUN, backend_settings("http", url))
        run_recipe(recipe, root / "run", show_progress=False)
        state = json.loads((root / "run" / STATE_FILE).read_text())
        job_id = state["training_job_id"].split(":")[0]
        config = {"model": TINY, "seed": 0, "backend": {"type": "http", "url": url}}
        client = create_arctic_rl_client(
            {**config, "training": {}, "sampling": {}}, blocking_calls=True
        )
        client.load_checkpoint(state["checkpoint_path"])
        client.sync_weights()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(builtin_model_path(TINY))

        def chat(prompt: str) -> list[int]:
            messages = [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        def ids(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        try:
            yield {
                "url": url,
                "client": client,
                "model": f"job:{job_id}/{state['checkpoint_id']}",
                "items": AdditionTask().eval_set()[:ITEMS],
                "chat": chat,
                "ids": ids,
                "pad": tokenizer.pad_token_id,
            }
        finally:
            client.close()
            service.close()


def lm_eval(run: dict, tmp: Path, model: str, task: str, body: str, *flags: str) -> list[dict]:
    """lm-eval's CLI on ``task`` over the run's items; the per-item records it logged."""
    data = tmp / "items.jsonl"
    data.write_text("".join(json.dumps(vars(e)) + "\n" for e in run["items"]))
    (tmp / "tasks").mkdir(exist_ok=True)
    (tmp / "tasks" / f"{task}.yaml").write_text(task_yaml(task, data, body))
    endpoint = "chat/completions" if "chat" in model else "completions"
    args = [
        f"model={run['model']}",
        f"base_url={run['url']}/v1/{endpoint}",
        "num_concurrent=1",
        "max_retries=1",
    ]
    if "chat" not in model:
        args += [f"tokenizer={builtin_model_path(TINY)}", "tokenized_requests=False"]
    out = tmp / "out"
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--tasks",
        task,
        "--include_path",
        str(tmp / "tasks"),
        "--model_args",
        ",".join(args),
        "--output_path",
        str(out),
        "--log_samples",
        *flags,
    ]
    env = {**os.environ, "OPENAI_API_KEY": "unused", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def test_lm_eval_generation_scores_what_our_greedy_generate_answers(run, tmp_path):
    records = lm_eval(
        run,
        tmp_path,
        "local-chat-completions",
        "arctic_addition_gen",
        GENERATE,
        "--apply_chat_template",
    )
    by_item = {r["doc"]["prompt"]: r for r in records}
    assert len(by_item) == ITEMS
    ours = run["client"].generate(
        prompt_ids=[run["chat"](e.prompt) for e in run["items"]],
        sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS, "stop": [STOP]},
    )
    # The warm-up taught the format: every answer is a number (the untrained model's are not).
    assert all(sample["text"].isdigit() for sample in ours), ours
    for example, sample in zip(run["items"], ours, strict=True):
        record = by_item[example.prompt]
        assert record["filtered_resps"] == [sample["text"]], example
        assert record["exact_match"] == float(sample["text"] == example.answer)


def test_lm_eval_loglikelihood_is_our_fwd_no_grad_log_probs(run, tmp_path):
    records = lm_eval(run, tmp_path, "local-completions", "arctic_addition_ll", LOGLIKELIHOOD)
    by_item = {r["doc"]["prompt"]: r for r in records}
    assert len(by_item) == ITEMS
    items = run["items"]
    batch = training_batch(
        [run["ids"](e.prompt) for e in items],
        [run["ids"](e.answer) for e in items],
        pad_token_id=run["pad"],
    )
    scored = run["client"].fwd_no_grad({"batch": batch})["batch"]
    logprobs = np.asarray(scored["logprobs"], dtype=np.float64)
    mask = np.asarray(batch["response_mask"], dtype=np.float64)
    ours = (logprobs * mask).sum(axis=1)
    assert len(set(np.round(ours, 2))) > 1  # the items differ, so a constant answer would fail
    for example, expected in zip(items, ours, strict=True):
        loglikelihood, _ = by_item[example.prompt]["filtered_resps"][0]
        assert float(loglikelihood) == pytest.approx(float(expected), abs=1e-4), example
