"""tinker-cookbook's own RL loop (``tinker_cookbook.rl.train``) on our addition task, against a
self-hosted ``arctic-platform serve``.

The loop is the cookbook's, unchanged: only ``base_url`` (our server) and ``model_name`` (a local
model folder: ``builtin:tiny`` materialised on disk, since the cookbook loads the tokenizer with
``AutoTokenizer.from_pretrained``) differ from a hosted run. As in our main job, a short supervised
warm-up (through the Tinker SDK, on the cookbook's ``role_colon`` rendering of the same
conversations) teaches the answer format first; the cookbook loop then starts from that
checkpoint (``load_checkpoint_path``) and improves the reward with ``importance_sampling`` on
groups of samples per question (GRPO-style centred advantages).

Run it (needs the ``tinker`` extra and ``pip install --no-deps tinker-cookbook==0.6.1``)::

    arctic-platform serve --port 7000 --allow-path ~/.cache/arctic-platform/models &
    python -m arctic_platform.recipes.tinker_addition --base-url http://127.0.0.1:7000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import chz
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer

from arctic_platform.engine.builtin import builtin_model_path
from arctic_platform.recipes.tasks import Example
from arctic_platform.recipes.tasks.addition import AdditionTask

RENDERER = "role_colon"
REWARD_KEY = "env/all/reward/total"


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


@chz.chz
class AdditionDatasetBuilder(RLDatasetBuilder):
    model_name: str
    max_operand: int = 9
    groups_per_batch: int = 8
    group_size: int = 8
    batches: int = 20
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return AdditionDataset(self), None


def warm_up(
    service_client: tinker.ServiceClient,
    model_name: str,
    *,
    steps: int,
    max_operand: int,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    lora_rank: int = 32,
    seed: int = 0,
) -> str:
    """Supervised warm-up through the Tinker SDK; returns the ``tinker://`` state path."""
    task = AdditionTask(max_operand=max_operand, eval_size=1, seed=seed)
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(model_name))
    client = service_client.create_lora_training_client(
        base_model=model_name, rank=lora_rank, seed=seed
    ).result()
    for step in range(steps):
        examples = task.train_batch(step, batch_size)
        data = [
            conversation_to_datum(
                [
                    {"role": "user", "content": ex.prompt},
                    {"role": "assistant", "content": ex.answer},
                ],
                renderer,
                max_length=None,
            )
            for ex in examples
        ]
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
    return client.save_state("warmup").result().path


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
    warm_state: str,
    steps: int,
    max_operand: int,
    groups_per_batch: int = 8,
    group_size: int = 8,
    learning_rate: float = 2e-3,
    lora_rank: int = 32,
) -> train.Config:
    """The cookbook's RL config; only ``base_url`` and ``model_name`` point at our server."""
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
        max_tokens=response_budget(model_name, max_operand),
        log_path=log_path,
        eval_every=0,
        save_every=0,
        load_checkpoint_path=warm_state,
        loss_fn="importance_sampling",
        lora_rank=lora_rank,
        base_url=base_url,
        max_steps=steps,
        num_groups_to_log=0,
    )


def reward_curve(log_path: str) -> list[float]:
    """The cookbook's per-step mean reward, from its ``metrics.jsonl``."""
    lines = (Path(log_path) / "metrics.jsonl").read_text().splitlines()
    return [row[REWARD_KEY] for row in map(json.loads, lines) if REWARD_KEY in row]


def run(
    base_url: str,
    log_path: str,
    *,
    api_key: str = "tml-local",
    warmup_steps: int = 150,
    rl_steps: int = 20,
    max_operand: int = 9,
) -> list[float]:
    """Warm up, then run the cookbook RL loop; returns its reward per step."""
    # The cookbook's ServiceClient takes its key from the environment, as the SDK documents.
    os.environ["TINKER_API_KEY"] = api_key
    model_name = builtin_model_path("builtin:tiny")
    service_client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        warm = warm_up(service_client, model_name, steps=warmup_steps, max_operand=max_operand)
    finally:
        service_client.close("success").result()
    config = rl_config(
        base_url, model_name, log_path, warm_state=warm, steps=rl_steps, max_operand=max_operand
    )
    asyncio.run(train.main(config))
    return reward_curve(log_path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:7000")
    parser.add_argument("--log-path", default="runs/tinker-addition")
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--rl-steps", type=int, default=20)
    args = parser.parse_args(argv)
    rewards = run(
        args.base_url, args.log_path, warmup_steps=args.warmup_steps, rl_steps=args.rl_steps
    )
    print(json.dumps({"reward_per_step": rewards}))


if __name__ == "__main__":
    main()
