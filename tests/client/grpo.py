"""One GRPO step as an RL loop writes it against the client, numpy only (no torch needed)."""

from __future__ import annotations

import numpy as np

from arctic_platform.advantages import grpo_advantages
from arctic_platform.layout import training_batch

PROMPTS = [[40, 41, 42], [50, 51, 52, 53]]  # token ids of the built-in character tokenizer
N = 4
SAMPLING = {"n": N, "max_tokens": 6, "temperature": 1.0, "seed": 11}
ACTOR = {"use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "low_var_kl"}
SCORING = {"post": ["compute_entropy_and_logprobs"], "loss_fn": None}


def reward(token_ids: list[int]) -> float:
    """A programmatic reward that differs between samples: the mean token id."""
    return float(np.mean(token_ids))


def build_batch(results: list[dict]) -> dict[str, np.ndarray]:
    """The verl-layout batch of ``results`` (``N`` samples per prompt) with GRPO advantages."""
    rewards = np.array([reward(r["token_ids"]) for r in results])
    advantages = grpo_advantages(rewards, group_size=N)
    prompts = [PROMPTS[i // N] for i in range(len(results))]
    responses = [list(r["token_ids"]) for r in results]
    return training_batch(prompts, responses, pad_token_id=0, advantages=advantages)


def train_envelope(batch: dict, old: np.ndarray, ref: np.ndarray) -> dict:
    mask = batch["response_mask"]
    tensors = {
        **batch,
        "old_log_probs": (np.asarray(old) * mask).astype(np.float32),
        "ref_log_prob": (np.asarray(ref) * mask).astype(np.float32),
    }
    meta = {
        "pad_token_id": 0,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": len(mask),
        "temperature": 1.0,
        "actor_config": ACTOR,
    }
    return {"batch": tensors, "meta": meta, "processing": {"loss_fn": "verl_grpo"}}


def run_grpo(client) -> dict:
    """generate -> reward -> advantages -> old/ref log-probs -> fwd_bwd -> step -> sync_weights
    -> save -> load -> a second step; every response, keyed by call."""
    out: dict = {}
    out["generate"] = client.generate(PROMPTS, SAMPLING)
    batch = build_batch(out["generate"])
    out["old"] = client.fwd_no_grad({"batch": batch, "processing": SCORING})
    out["ref"] = client.fwd_no_grad({"batch": batch, "processing": SCORING}, reference_model=True)
    envelope = train_envelope(
        batch, out["old"]["batch"]["logprobs"], out["ref"]["batch"]["logprobs"]
    )
    out["fwd_bwd"] = client.fwd_bwd(envelope)
    out["step"] = client.step()
    out["sync_weights"] = client.sync_weights()
    out["generate_after_sync"] = client.generate(PROMPTS, SAMPLING)
    out["save"] = client.save_checkpoint()
    out["load"] = client.load_checkpoint(checkpoint_id=out["save"]["checkpoint_id"])
    out["fwd_bwd_2"] = client.fwd_bwd(envelope)
    out["step_2"] = client.step()
    out["final"] = client.fwd_no_grad({"batch": batch})
    out["batch"] = batch
    return out
