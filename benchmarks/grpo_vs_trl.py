"""The main job's GRPO step against TRL's ``GRPOTrainer``, configured the same way, on CPU.

Both start from the same SFT checkpoint (the default recipe's warm-up, run here through our client
and exported in HF format), see the same prompts in the same order (32 prompts x 8 samples a
step, the default recipe's GRPO batches), and train with the same objective: PPO-clip at 0.2,
token-mean over the batch (TRL's ``dapo``), group-normalised advantages, no KL term (``beta=0``),
no entropy term, one optimizer step per batch (no separate old-log-prob pass on either side:
ours takes the ratio against the current policy, TRL reuses the current log-probs, detached),
AdamW at the recipe's learning rate with the same cosine decay and gradient clipping, fp32, and
generation by each side's own engine (TRL: transformers ``generate``; no vLLM).

Steps alternate in one process: TRL's trainer runs, and a callback times each of its steps
(``on_step_begin`` to ``on_step_end``: generation, rewards, loss, backward, optimizer) and runs one
of our steps right after it (generate, rewards, fwd_bwd, step, weight sync). Each side's held-out
greedy accuracy (the recipe's 200 held-out sums) is measured the same way for both, with
transformers ``generate`` on each side's weights, after the warm-up and at the end.

TRL is an optional benchmark dependency: ``pip install -c constraints.txt -e ".[bench]"``.

Run: ``python -m benchmarks.grpo_vs_trl [--steps 200] [--threads 1]``. Writes
``benchmarks/results/grpo_vs_trl.json`` (also every ``--save-every`` steps, so a run stopped early
still reports the steps it finished).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

MAX_NEW_TOKENS = 5


def load_recipe_for(steps: int, sft_steps: int | None):
    from arctic_platform.recipes.config import load_recipe

    overrides = [f"grpo.steps={steps}", "eval.every=0", "checkpoint.every=0"]
    if sft_steps is not None:
        overrides.append(f"sft.steps={sft_steps}")
    return load_recipe(None, overrides)


def greedy_accuracy(model, tokenizer, task, examples, prompt_ids) -> float:
    """Held-out reward of greedy completions with transformers ``generate`` (left padding)."""
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad,
        )
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return statistics.fmean(task.reward(t, e) for t, e in zip(texts, examples, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="GRPO steps (both sides)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--sft-steps", type=int, help="warm-up steps (default: the recipe's)")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from arctic_platform.client import create_arctic_rl_client
    from arctic_platform.engine.config import ModelConfig
    from arctic_platform.engine.models import load_tokenizer
    from arctic_platform.recipes.grpo import GRPO_DATA_OFFSET, _client_config, _Recipe
    from arctic_platform.recipes.tasks import Example
    from benchmarks._common import write_result

    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_recipe_for(args.steps, args.sft_steps)
    grpo, sft = config.grpo, config.sft
    work = Path(tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    tokenizer = load_tokenizer(ModelConfig(name=config.client.model))
    client = create_arctic_rl_client(_client_config(config, work / "ours"), blocking_calls=True)
    ours = _Recipe(config, work / "ours", client, tokenizer)
    task = ours.task
    eval_prompts = ours.prompt_ids(ours.eval_examples)

    started = time.perf_counter()
    for step in range(sft.steps):
        ours.sft_step(step)
    client.sync_weights()
    sft_seconds = time.perf_counter() - started
    hf_path = client.save_checkpoint(export_hf=True)["hf_path"]

    # The same prompts, in the order our recipe draws them, as TRL's dataset (no shuffling).
    rows = []
    for step in range(sft.steps, sft.steps + args.steps):
        for example in task.train_batch(GRPO_DATA_OFFSET + step, grpo.prompts_per_step):
            rows.append({"prompt": example.prompt, "answer": example.answer})
    dataset = Dataset.from_list(rows)

    def exact_match(prompts, completions, answer, **_) -> list[float]:
        return [
            task.reward(c, Example(prompt=p, answer=a))
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]

    trl_tokenizer = load_tokenizer(ModelConfig(name=config.client.model))
    trl_tokenizer.padding_side = "left"
    assert (
        trl_tokenizer(text=[rows[0]["prompt"]])["input_ids"][0]
        == ours.prompt_ids(task.train_batch(GRPO_DATA_OFFSET + sft.steps, 1))[0]
    ), "TRL must tokenize prompts as our recipe does"
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    trl_config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=grpo.prompts_per_step * grpo.samples_per_prompt,
        num_generations=grpo.samples_per_prompt,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=grpo.max_tokens,
        temperature=grpo.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=grpo.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=config.client.training.optimizer.grad_clip,
        beta=0.0,
        epsilon=grpo.clip_ratio,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=args.steps,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        use_vllm=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=config.seed,
        disable_dropout=True,
        dataloader_num_workers=0,
    )

    times: dict[str, list[float]] = {"ours": [], "trl": []}
    result: dict = {}

    def report(final: bool) -> None:
        done = len(times["ours"])
        medians = {side: statistics.median(t) for side, t in times.items() if t}
        result.update(
            {
                "model": config.client.model,
                "note": (
                    "steps alternate in one process (TRL step, then ours); step time covers "
                    "generation, rewards, fwd/bwd and the optimizer step (ours also the weight "
                    "sync to its sampler); accuracies by transformers greedy generate on each "
                    "side's weights"
                ),
                "settings": {
                    "steps_requested": args.steps,
                    "steps_done": done,
                    "finished": final,
                    "prompts_per_step": grpo.prompts_per_step,
                    "samples_per_prompt": grpo.samples_per_prompt,
                    "max_new_tokens": grpo.max_tokens,
                    "learning_rate": grpo.learning_rate,
                    "loss": "ppo-clip 0.2, token-mean (trl dapo), beta 0, one update per batch",
                    "sft_steps": sft.steps,
                    "sft_seconds": sft_seconds,
                    "torch_threads": torch.get_num_threads(),
                },
                "median_step_seconds": medians,
                "ratio_ours_vs_trl_step_time": (
                    medians["ours"] / medians["trl"] if len(medians) == 2 else None
                ),
                "target_ratio": 0.7,
                "step_seconds": times,
                "heldout_accuracy_after_sft": accuracy_after_sft,
                "target_accuracy_gap": 0.03,
            }
        )
        if final:
            result["heldout_accuracy"] = {
                "ours": greedy_accuracy(
                    _our_model(client, hf_path), tokenizer, task, ours.eval_examples, eval_prompts
                ),
                "trl": greedy_accuracy(
                    trainer.model, tokenizer, task, ours.eval_examples, eval_prompts
                ),
            }
            result["accuracy_gap"] = abs(
                result["heldout_accuracy"]["ours"] - result["heldout_accuracy"]["trl"]
            )
            result["ours_recipe_eval"] = ours.evaluate()
        write_result("grpo_vs_trl", result)

    class Alternate(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            times["trl"].append(time.perf_counter() - self.started)
            step = sft.steps + len(times["ours"])
            begun = time.perf_counter()
            ours.grpo_step(step)
            times["ours"].append(time.perf_counter() - begun)
            if len(times["ours"]) % args.save_every == 0:
                report(final=False)

    accuracy_after_sft = greedy_accuracy(model, tokenizer, task, ours.eval_examples, eval_prompts)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=trl_config,
        train_dataset=dataset,
        processing_class=trl_tokenizer,
        callbacks=[Alternate()],
    )
    trainer.train()
    report(final=True)
    client.shutdown()


def _our_model(client, previous_hf_path: str):
    """Our trained weights as a transformers model (an HF export of the current checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = client.save_checkpoint(export_hf=True)["hf_path"]
    assert path != previous_hf_path
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


if __name__ == "__main__":
    main()
