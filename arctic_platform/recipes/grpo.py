"""The main job: a short SFT warm-up, then GRPO, through the client's calls only.

One step of GRPO, as any framework would write it against the client::

    samples   = client.generate(prompt_ids, {n, temperature, max_tokens, seed})
    rewards   = task.reward(sample, example)                # programmatic, client side
    advantage = grpo_advantages(rewards, group_size=n)      # group-normalised
    batch     = training_batch(prompts, samples, advantages)   # verl layout, DESIGN.md §3
    client.fwd_bwd({"batch": batch, "meta": actor_config,
                    "processing": {"loss_fn": "verl_grpo",
                                   "config": {"old_log_probs": "current"}}})
    client.step(learning_rate)
    client.sync_weights()                                   # the sampler follows the trainer

Each batch gets one update, so the PPO ratio's old log-probs are the current policy's: the loss
takes them from its own forward, detached (the on-policy form), and no separate ``fwd_no_grad``
pass recomputes them. With ``grpo.updates_per_batch > 1`` the old log-probs must predate the first
update: a ``fwd_no_grad`` scores them, and each update sends them as ``old_log_probs``.

Everything that makes a run reproducible lives in the inputs: task batches and sampling seeds are
functions of the step, so a run resumed from a checkpoint continues with the same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from arctic_platform.advantages import grpo_advantages
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.layout import training_batch
from arctic_platform.recipes.config import RecipeConfig
from arctic_platform.recipes.run_log import PLOT_FILE, MetricsLog, Progress, plot_run
from arctic_platform.recipes.tasks import Example, Task, build_task
from arctic_platform.recipes.trackers import RunTrackers, check_installed

STATE_FILE = "state.json"
# Task batches of the GRPO phase are drawn from a separate step range than the SFT ones.
GRPO_DATA_OFFSET = 1_000_000


@dataclass
class RunSummary:
    """Where the run's files are and how it went."""

    run_dir: Path
    metrics_path: Path
    plot_path: Path
    records: list[dict[str, Any]]

    def eval_rewards(self, phase: str | None = None) -> list[float]:
        return [
            r["eval_reward"]
            for r in self.records
            if r.get("eval_reward") is not None and (phase is None or r["phase"] == phase)
        ]


class _Recipe:
    """State of one run: the client, the tokenizer, the task and the metrics log."""

    def __init__(self, config: RecipeConfig, run_dir: Path, client, tokenizer, task: Task) -> None:
        self.config = config
        self.run_dir = run_dir
        self.client = client
        self.tokenizer = tokenizer
        self.task = task
        self.eval_examples = self.task.eval_set()[: config.eval.size]
        eos = tokenizer.eos_token_id
        self.eos_id = eos
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    # -- data -----------------------------------------------------------------------------

    def prompt_ids(self, examples: list[Example]) -> list[list[int]]:
        texts = [e.prompt for e in examples]
        if self.config.task.chat_template:
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    def sft_batch(self, examples: list[Example]) -> dict[str, np.ndarray]:
        prompts = self.prompt_ids(examples)
        targets = [
            self.tokenizer(self.task.sft_completion(e), add_special_tokens=False)["input_ids"]
            + [self.eos_id]
            for e in examples
        ]
        batch = training_batch(prompts, targets, pad_token_id=self.pad_id)
        labels = np.where(batch["response_mask"] == 1, batch["input_ids"], -100)
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "position_ids": batch["position_ids"],
            "labels": labels,
        }

    # -- phases ---------------------------------------------------------------------------

    def sft_step(self, step: int) -> dict[str, Any]:
        sft = self.config.sft
        examples = self.task.train_batch(step, sft.batch_size)
        started = time.perf_counter()
        batch = self.sft_batch(examples)
        out = self.client.fwd_bwd(
            {
                "batch": batch,
                "meta": {"pad_token_id": self.pad_id},
                "processing": {"loss_fn": "cross_entropy"},
            }
        )
        stepped = self.client.step(learning_rate=sft.learning_rate_at(step))
        elapsed = time.perf_counter() - started
        tokens = int(batch["attention_mask"].sum())
        return {
            "phase": "sft",
            "loss": out["loss"],
            "grad_norm": stepped["grad_norm"],
            "lr": stepped["last_lr"],
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed,
            "time_train_s": elapsed,
        }

    def grpo_step(self, step: int) -> dict[str, Any]:
        grpo = self.config.grpo
        n = grpo.samples_per_prompt
        examples = self.task.train_batch(GRPO_DATA_OFFSET + step, grpo.prompts_per_step)
        prompts = self.prompt_ids(examples)
        started = time.perf_counter()
        samples = self.client.generate(
            prompt_ids=prompts,
            sampling_params={
                "n": n,
                "temperature": grpo.temperature,
                "max_tokens": grpo.max_tokens,
                "seed": self.config.seed * 1_000_003 + step,
            },
        )
        generated = time.perf_counter()
        rewards = np.array(
            [self.task.reward(s["text"], examples[i // n]) for i, s in enumerate(samples)]
        )
        advantages = grpo_advantages(rewards, group_size=n, norm_by_std=grpo.norm_adv_by_std)
        batch = training_batch(
            [prompts[i // n] for i in range(len(samples))],
            [list(s["token_ids"]) for s in samples],
            pad_token_id=self.pad_id,
            advantages=advantages,
        )
        meta = {
            "pad_token_id": self.pad_id,
            "temperature": grpo.temperature,
            "calculate_entropy": True,  # reported (and in the loss only if entropy_coeff != 0)
            "actor_config": {
                "clip_ratio": grpo.clip_ratio,
                "loss_agg_mode": grpo.loss_agg_mode,
                "use_kl_loss": grpo.use_kl_loss,
                "kl_loss_coef": grpo.kl_loss_coef,
                "kl_loss_type": grpo.kl_loss_type,
                "entropy_coeff": grpo.entropy_coeff,
            },
        }
        processing: dict[str, Any] = {"loss_fn": "verl_grpo"}
        if grpo.updates_per_batch == 1:
            processing["config"] = {"old_log_probs": "current"}
        else:
            old = self.client.fwd_no_grad(
                {"batch": batch, "meta": {"temperature": meta["temperature"]}}
            )
            batch = {**batch, "old_log_probs": np.asarray(old["batch"]["logprobs"])}
        scored = time.perf_counter()
        for _ in range(grpo.updates_per_batch):
            out = self.client.fwd_bwd({"batch": batch, "meta": meta, "processing": processing})
            stepped = self.client.step(
                learning_rate=grpo.learning_rate_at(step - self.config.sft.steps)
            )
        trained = time.perf_counter()
        self.client.sync_weights()
        synced = time.perf_counter()
        lengths = [len(s["token_ids"]) for s in samples]
        tokens = int(batch["attention_mask"].sum())
        metrics = out["metrics"]
        return {
            "phase": "grpo",
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "pass_rate": float(np.mean(rewards.reshape(-1, n).max(axis=1) > 0)),
            "loss": out["loss"],
            "kl": metrics.get("actor/ppo_kl"),
            "entropy": metrics.get("actor/entropy_loss"),
            "clipfrac": metrics.get("actor/pg_clipfrac"),
            "grad_norm": stepped["grad_norm"],
            "lr": stepped["last_lr"],
            "response_len_mean": float(np.mean(lengths)),
            "tokens": tokens,
            "tokens_per_s": tokens / (synced - started),
            "time_generate_s": generated - started,
            "time_logprobs_s": scored - generated,
            "time_train_s": trained - scored,
            "time_sync_s": synced - trained,
        } | ({"kl_loss": metrics["kl_loss"]} if "kl_loss" in metrics else {})

    def evaluate(self) -> float:
        """Mean reward of greedy completions on the held-out set."""
        outputs = self.client.generate(
            prompt_ids=self.prompt_ids(self.eval_examples),
            sampling_params={"temperature": 0.0, "max_tokens": self.config.eval.max_tokens},
        )
        scores = [
            self.task.reward(o["text"], e) for o, e in zip(outputs, self.eval_examples, strict=True)
        ]
        return float(np.mean(scores))


def run_recipe(
    config: RecipeConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
) -> RunSummary:
    """Run ``config``, writing into ``run_dir``; ``resume`` continues from its last checkpoint."""
    from arctic_platform.client import create_arctic_rl_client
    from arctic_platform.engine.config import ModelConfig
    from arctic_platform.engine.models import load_tokenizer

    check_installed(config.logging.backends)
    # The task first: its options (and data files) are checked before anything is written or
    # started, so a wrong one costs no engine start and no warm-up.
    task = build_task(config.task.name, **config.task.options())
    run_dir.mkdir(parents=True, exist_ok=True)
    state = _read_state(run_dir) if resume else None
    if resume and state is None:
        raise ValueError(f"--resume: {run_dir} has no checkpointed run to resume")
    (run_dir / "recipe.json").write_text(config.model_dump_json(indent=2, by_alias=True))
    client_config = _client_config(config, run_dir)
    tokenizer = load_tokenizer(ModelConfig(name=client_config.model or "builtin:tiny"))
    client = create_arctic_rl_client(client_config, blocking_calls=True)
    try:
        recipe = _Recipe(config, run_dir, client, tokenizer, task)
        start = 0
        if state is not None:
            _restore(client, state)
            start = state.step + 1
        log = MetricsLog(run_dir, resume_after=start - 1 if state is not None else None)
        trackers = RunTrackers(
            config.logging.backends,
            run_dir,
            project=config.logging.project or config.name,
            run_name=config.logging.run_name or run_dir.resolve().name,
            config=config.model_dump(mode="json", by_alias=True),
            start_step=start,
            history=log.records,
        )
        plot_path = run_dir / PLOT_FILE
        finished = False
        try:
            _train(config, recipe, client, log, trackers, start, show_progress)
            finished = True
        finally:
            trackers.close(failed=not finished)
        plot_run(log.records, plot_path, title=config.name)
    finally:
        client.shutdown()
    return RunSummary(run_dir, log.path, plot_path, log.records)


def _train(
    config: RecipeConfig,
    recipe: _Recipe,
    client,
    log: MetricsLog,
    trackers: RunTrackers,
    start: int,
    show_progress: bool,
) -> None:
    """Steps ``start`` to the end: each record to the log and the trackers, the plot redrawn
    every ``logging.plot_every`` steps, checkpoints as configured."""
    last_eval = next(
        (r["eval_reward"] for r in reversed(log.records) if r.get("eval_reward") is not None),
        None,
    )
    plot_every = config.logging.plot_every
    with Progress(config.total_steps, enabled=show_progress) as progress:
        for step in range(start, config.total_steps):
            in_sft = step < config.sft.steps
            record = {"step": step}
            record.update(recipe.sft_step(step) if in_sft else recipe.grpo_step(step))
            evaluate = _is_eval_step(config, step)
            if in_sft and (evaluate or step == config.sft.steps - 1):
                client.sync_weights()  # the sampler evaluates, and GRPO starts from, these
            if evaluate:
                started = time.perf_counter()
                last_eval = record["eval_reward"] = recipe.evaluate()
                record["time_eval_s"] = time.perf_counter() - started
            log.append(record)
            trackers.log(record)
            progress.update(record, step + 1, last_eval)
            if plot_every and (step + 1) % plot_every == 0:
                plot_run(log.records, recipe.run_dir / PLOT_FILE, title=config.name)
            if _is_checkpoint_step(config, step):
                _checkpoint(client, recipe.run_dir, step, config.checkpoint.keep)


def _client_config(config: RecipeConfig, run_dir: Path):
    """The recipe's client config, seeded, with engine data kept inside the run directory."""
    client = config.client
    if client.seed is None:
        client = client.model_copy(update={"seed": config.seed})
    backend = client.backend
    if hasattr(backend, "data_dir") and "data_dir" not in backend.model_fields_set:
        backend = backend.model_copy(update={"data_dir": run_dir / "engine-data"})
        client = client.model_copy(update={"backend": backend})
    return client


def _is_eval_step(config: RecipeConfig, step: int) -> bool:
    every = config.eval.every
    boundary = step in (config.sft.steps - 1, config.total_steps - 1)
    return boundary or (every > 0 and (step + 1) % every == 0)


def _is_checkpoint_step(config: RecipeConfig, step: int) -> bool:
    every = config.checkpoint.every
    return step == config.total_steps - 1 or (every > 0 and (step + 1) % every == 0)


def _checkpoint(client, run_dir: Path, step: int, keep: int) -> None:
    saved = client.save_checkpoint(save_total_limit=keep)
    state = RunState(
        step=step,
        checkpoint_path=saved.get("path"),
        checkpoint_id=saved.get("checkpoint_id"),
        training_job_id=client.training_job_id,
    )
    temporary = run_dir / (STATE_FILE + ".tmp")
    temporary.write_text(state.model_dump_json(indent=2))
    temporary.replace(run_dir / STATE_FILE)


class RunState(BaseModel):
    """``state.json``: the last checkpointed step and where its checkpoint is (by path, and by
    id for the Cortex API, which loads by id)."""

    model_config = ConfigDict(extra="forbid")

    step: NonNegativeInt
    checkpoint_path: str | None = None
    checkpoint_id: str | None = None
    training_job_id: str | None = None


def _read_state(run_dir: Path) -> RunState | None:
    """The run's state, or None when it has none; a ``ValueError`` naming the file for one this
    recipe did not write (it was a KeyError or TypeError traceback on --resume)."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        return RunState.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"--resume: {path}: cannot be read ({exc.strerror})") from None
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem["loc"]) or "the file"
        raise ValueError(
            f"--resume: {path} is not a run state this recipe wrote ({where}: {problem['msg']})"
        ) from None


def _restore(client, state: RunState) -> None:
    """Load the trainer's checkpoint and give the sampler the same weights."""
    if client.config.backend.type == "cortex":
        if state.checkpoint_id is None or state.training_job_id is None:
            raise ValueError(
                f"--resume: {STATE_FILE} names no checkpoint_id and training_job_id to load "
                "over the Cortex API"
            )
        client.load_checkpoint(
            checkpoint_id=state.checkpoint_id, source_job_id=parent_of(state.training_job_id)
        )
    else:
        if state.checkpoint_path is None:
            raise ValueError(f"--resume: {STATE_FILE} names no checkpoint_path")
        client.load_checkpoint(path=state.checkpoint_path)
    client.sync_weights()
