"""tinker-cookbook's own RL loop (``tinker_cookbook.rl.train``) on our addition task, against a
self-hosted ``arctic-platform serve``.

The loop is the cookbook's, unchanged: only ``base_url`` (our server) and ``model_name`` (a local
model folder, since the cookbook loads the tokenizer with ``AutoTokenizer.from_pretrained``)
differ from a hosted run. As in our main job, a short supervised warm-up first teaches the answer
format and some sums: our client trains ``builtin:tiny`` (full fine-tune) on the same server on the
cookbook's ``role_colon`` rendering of the conversations and exports it as a HF folder, which is
the cookbook's ``model_name``. The cookbook loop then trains LoRA adapters on it with
``importance_sampling`` on groups of samples per question (GRPO-style centred advantages), and
its test-set evaluator scores every sum before the first step and after the last.

Run it (needs the ``tinker`` extra and ``pip install --no-deps tinker-cookbook==0.6.1``). The
server must share this machine's filesystem, where the cookbook reads the tokenizer, and let the
tenant write the warm-up there: a server hides its own data folder from tenants, so the export goes
to a folder the operator shares with ``--allow-write-path``::

    arctic-platform serve --port 7000 --allow-write-path runs &
    python -m arctic_platform.recipes.tinker_addition --base-url http://127.0.0.1:7000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import chz
import numpy as np
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer

from arctic_platform.client.factory import create_arctic_rl_client
from arctic_platform.engine.builtin import builtin_model_path
from arctic_platform.layout import training_batch
from arctic_platform.recipes.tasks import Example
from arctic_platform.recipes.tasks.addition import AdditionTask

RENDERER = "role_colon"
REWARD_KEY = "env/all/reward/total"
GREEDY_KEY = "test/greedy_accuracy"


class AdditionEnv(ProblemEnv):
    """One sum to answer; correct answers score 1 (the cookbook adds its format penalty)."""

    def __init__(self, renderer: renderers.Renderer, example: Example, task: AdditionTask):
        super().__init__(renderer)
        self.example = example
        self.task = task

    def get_question(self) -> str:
        return self.example.prompt

    def check_answer(self, sample_str: str) -> bool:
        return self.task.reward(sample_str, self.example) == 1.0

    def check_format(self, sample_str: str) -> bool:
        return sample_str.strip().isdigit()

    def get_reference_answer(self) -> str:
        return self.example.answer


class AdditionDataset(RLDataset):
    """Training batches of ``groups_per_batch`` sums, ``group_size`` samples each."""

    def __init__(self, builder: AdditionDatasetBuilder) -> None:
        self.builder = builder
        self.task = AdditionTask(max_operand=builder.max_operand, eval_size=1, seed=builder.seed)
        self.renderer = renderers.get_renderer(RENDERER, get_tokenizer(builder.model_name))

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        examples = self.task.train_batch(index, self.builder.groups_per_batch)
        return [
            ProblemGroupBuilder(
                env_thunk=partial(AdditionEnv, self.renderer, example, self.task),
                num_envs=self.builder.group_size,
                dataset_name="addition",
            )
            for example in examples
        ]

    def __len__(self) -> int:
        return self.builder.batches


class GreedyAccuracy(SamplingClientEvaluator):
    """The share of all the task's sums the policy answers right, greedily (temperature 0): the
    cookbook runs it before the first RL step and after the last (``evaluator_builders``)."""

    def __init__(self, model_name: str, max_operand: int, max_tokens: int) -> None:
        self.renderer = renderers.get_renderer(RENDERER, get_tokenizer(model_name))
        self.sums = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        self.params = types.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, stop=self.renderer.get_stop_sequences()
        )

    async def __call__(self, sampling_client: tinker.SamplingClient) -> dict[str, float]:
        def prompt(a: int, b: int) -> types.ModelInput:
            return self.renderer.build_generation_prompt([{"role": "user", "content": f"{a}+{b}="}])

        answers = await asyncio.gather(
            *(sampling_client.sample_async(prompt(a, b), 1, self.params) for a, b in self.sums)
        )
        right = 0
        for (a, b), answer in zip(self.sums, answers, strict=True):
            message, ending = self.renderer.parse_response(answer.sequences[0].tokens)
            text = renderers.get_text_content(message).strip()
            right += ending.is_stop_sequence and text == str(a + b)
        return {GREEDY_KEY: right / len(self.sums)}


@chz.chz
class AdditionDatasetBuilder(RLDatasetBuilder):
    """The cookbook's dataset builder for our task; :func:`rl_config` sets every field."""

    model_name: str
    max_operand: int
    groups_per_batch: int
    group_size: int
    batches: int
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return AdditionDataset(self), None


def warm_up(
    base_url: str,
    export_dir: str,
    *,
    steps: int,
    max_operand: int,
    token_env: str | None = None,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> str:
    """The main job's supervised warm-up, through our client on the same server: ``builtin:tiny``
    fully fine-tuned on the cookbook's rendering of the task's conversations, exported as a HF
    folder under ``export_dir`` (a folder this machine and the server share), whose path it
    returns."""
    tokenizer = get_tokenizer(builtin_model_path("builtin:tiny"))
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    task = AdditionTask(max_operand=max_operand, eval_size=1, seed=seed)
    client = create_arctic_rl_client(
        {
            "model": "builtin:tiny",
            "seed": seed,
            "backend": {"type": "http", "url": base_url, "token_env": token_env},
            "training": {"optimizer": {"lr": learning_rate, "grad_clip": 1.0}},
        },
        blocking_calls=True,
    )
    with client:
        for step in range(steps):
            batch = sft_batch(renderer, task.train_batch(step, batch_size), tokenizer.pad_token_id)
            client.fwd_bwd({"batch": batch, "processing": {"loss_fn": "cross_entropy"}})
            client.step(learning_rate)
        return client.save_checkpoint(path=str(Path(export_dir).resolve()), export_hf=True)[
            "hf_path"
        ]


def sft_batch(
    renderer: renderers.Renderer, examples: Sequence[Example], pad_token_id: int
) -> dict[str, np.ndarray]:
    """Each example as the cookbook renders its conversation (``conversation_to_datum``), in our
    layout: the answer and stop sequence (the datum's weighted tokens) are the labels."""
    prompts, answers = [], []
    for ex in examples:
        conversation = [
            {"role": "user", "content": ex.prompt},
            {"role": "assistant", "content": ex.answer},
        ]
        datum = conversation_to_datum(conversation, renderer, max_length=None)
        targets = datum.loss_fn_inputs["target_tokens"].to_numpy().tolist()
        tokens = datum.model_input.to_ints() + targets[-1:]
        first = int(np.argmax(datum.loss_fn_inputs["weights"].to_numpy() > 0)) + 1
        prompts.append(tokens[:first])
        answers.append(tokens[first:])
    batch = training_batch(prompts, answers, pad_token_id=pad_token_id)
    labels = np.where(batch["response_mask"] == 1, batch["input_ids"], -100)
    keys = ("input_ids", "attention_mask", "position_ids")
    return {**{k: batch[k] for k in keys}, "labels": labels}


def response_budget(model_name: str, max_operand: int) -> int:
    """Tokens a sample needs to be rewarded: the longest answer, then the renderer's stop sequence
    (the cookbook scores the format only when the stop sequence was sampled)."""
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(model_name))
    message = {"role": "assistant", "content": str(2 * max_operand)}
    datum = conversation_to_datum([{"role": "user", "content": "?"}, message], renderer, None)
    return int((datum.loss_fn_inputs["weights"].to_numpy() > 0).sum())


def rl_config(
    base_url: str,
    model_name: str,
    log_path: str,
    *,
    steps: int,
    max_operand: int,
    groups_per_batch: int = 32,
    group_size: int = 8,
    learning_rate: float = 1e-3,
    lora_rank: int = 32,
) -> train.Config:
    """The cookbook's RL config; only ``base_url`` and ``model_name`` point at our server.
    :class:`GreedyAccuracy` runs before the first step and after the last (``eval_every``).

    32 groups of 8 a step, as our main job's GRPO (32 prompts x 8): with 8 groups the gain of 24
    steps was a draw (+0.01 to +0.11 from a 0.64 warm-up), too few samples a step for the signal
    to beat the noise; with 32 it was +0.14 to +0.16."""
    max_tokens = response_budget(model_name, max_operand)
    return train.Config(
        learning_rate=learning_rate,
        dataset_builder=AdditionDatasetBuilder(
            model_name=model_name,
            max_operand=max_operand,
            groups_per_batch=groups_per_batch,
            group_size=group_size,
            batches=steps,
        ),
        model_name=model_name,
        recipe_name="arctic_platform_tinker_addition",
        renderer_name=RENDERER,
        max_tokens=max_tokens,
        log_path=log_path,
        evaluator_builders=[partial(GreedyAccuracy, model_name, max_operand, max_tokens)],
        eval_every=steps,
        save_every=0,
        loss_fn="importance_sampling",
        lora_rank=lora_rank,
        base_url=base_url,
        max_steps=steps,
        num_groups_to_log=0,
    )


@dataclass(frozen=True)
class Progress:
    """What the cookbook logged: the mean reward of each RL step's samples, and the greedy
    accuracy before the first step and after the last."""

    reward_per_step: list[float]
    greedy_accuracy: list[float]


def logged_progress(log_path: str) -> Progress:
    """The rewards and accuracies in the cookbook's ``metrics.jsonl``."""
    lines = (Path(log_path) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return Progress(
        reward_per_step=[row[REWARD_KEY] for row in rows if REWARD_KEY in row],
        greedy_accuracy=[row[GREEDY_KEY] for row in rows if GREEDY_KEY in row],
    )


def run(
    base_url: str,
    log_path: str,
    *,
    warmup_dir: str | None = None,
    api_key: str = "tml-local",
    warmup_steps: int = 100,
    rl_steps: int = 24,
    max_operand: int = 9,
) -> Progress:
    """Warm up, then run the cookbook RL loop on the warmed-up model; returns its progress. The
    warm-up is exported to ``warmup_dir`` (default: ``<log_path>-warm-up``), which the server
    must be allowed to write (``--allow-write-path``)."""
    # The cookbook's ServiceClient takes its key from the environment, as the SDK documents;
    # our client sends the same key, so both work in the same tenant.
    os.environ["TINKER_API_KEY"] = api_key
    model_name = warm_up(
        base_url,
        warmup_dir or f"{log_path.rstrip('/')}-warm-up",
        steps=warmup_steps,
        max_operand=max_operand,
        token_env="TINKER_API_KEY",
    )
    config = rl_config(base_url, model_name, log_path, steps=rl_steps, max_operand=max_operand)
    asyncio.run(train.main(config))
    return logged_progress(log_path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:7000")
    parser.add_argument("--log-path", default="runs/tinker-addition")
    parser.add_argument("--warmup-dir", help="where the warm-up is exported (<log-path>-warm-up)")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--rl-steps", type=int, default=24)
    args = parser.parse_args(argv)
    progress = run(
        args.base_url,
        args.log_path,
        warmup_dir=args.warmup_dir,
        warmup_steps=args.warmup_steps,
        rl_steps=args.rl_steps,
    )
    print(json.dumps(asdict(progress)))


if __name__ == "__main__":
    main()
