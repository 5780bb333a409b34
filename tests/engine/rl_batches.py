"""Builders of verl-layout test batches and plain references on the HF model."""

from __future__ import annotations

import numpy as np
import torch

from arctic_platform.engine.config import ModelConfig, TrainingEngineConfig
from arctic_platform.layout import training_batch

TINY = ModelConfig(name="builtin:tiny")


def engine_config(**overrides) -> TrainingEngineConfig:
    return TrainingEngineConfig(**{"model": TINY, **overrides})


def rl_batch(
    rows: int = 6,
    prompt_width: int = 7,
    response_width: int = 9,
    *,
    seed: int = 0,
    prompt_lengths: list[int] | None = None,
    response_lengths: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """A verl batch: prompts left-padded to P, responses right-padded to R, varied lengths.

    ``old_log_probs`` are noise around zero (the loss tests do not need them to be realistic);
    advantages are one value per row, spread over its response tokens.
    """
    g = torch.Generator().manual_seed(seed)
    width = prompt_width + response_width
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    response_mask = torch.zeros(rows, width)
    for b in range(rows):
        p = prompt_lengths[b] if prompt_lengths else 1 + (b * 3) % prompt_width
        r = response_lengths[b] if response_lengths else 1 + (b * 5 + 2) % response_width
        input_ids[b, prompt_width - p : prompt_width + r] = torch.randint(
            5, 100, (p + r,), generator=g
        )
        attention_mask[b, prompt_width - p : prompt_width + r] = 1
        response_mask[b, prompt_width : prompt_width + r] = 1
    advantages = torch.randn(rows, 1, generator=g) * response_mask
    old = (torch.randn(rows, width, generator=g) * 0.1 - 4.6) * response_mask
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompts": input_ids[:, :prompt_width],
        "responses": input_ids[:, prompt_width:],
        "response_mask": response_mask,
        "advantages": advantages,
        "old_log_probs": old,
    }


# (times sampled, prompt length) per prompt; responses are 1..6 tokens.
GROUPS = [(4, 23), (1, 9), (3, 17), (2, 30), (1, 2), (5, 12)]


def shared_prompt_batch(seed: int = 0, groups=GROUPS) -> dict[str, np.ndarray]:
    """Prompts sampled ``n`` times each (rows of a prompt not adjacent), verl layout, with
    ``advantages``, ``old_log_probs`` and ``ref_log_prob``."""
    rng = np.random.default_rng(seed)
    samples = []
    for n, length in groups:
        prompt = rng.integers(5, 100, length).tolist()
        samples += [(prompt, rng.integers(5, 100, rng.integers(1, 7)).tolist()) for _ in range(n)]
    order = rng.permutation(len(samples))
    prompts = [samples[i][0] for i in order]
    responses = [samples[i][1] for i in order]
    advantages = rng.normal(size=len(prompts)).astype(np.float32)
    batch = training_batch(prompts, responses, pad_token_id=0, advantages=advantages)
    noise = rng.normal(-2.0, 0.3, batch["input_ids"].shape).astype(np.float32)
    batch["old_log_probs"] = noise * batch["response_mask"]
    batch["ref_log_prob"] = (noise + 0.1) * batch["response_mask"]
    return batch


def saved_prompt_tokens(groups) -> int:
    """Prompt tokens a shared pass does not recompute: ``(n - 1) * (p - 1)`` per prompt."""
    return sum((n - 1) * (p - 1) for n, p in groups)


def rows_of(batch: dict, index) -> dict:
    return {k: v[index] for k, v in batch.items()}


def reference_logprobs(model, input_ids, attention_mask, *, temperature: float = 1.0):
    """Position-indexed log-probs and entropies by running each row alone, unpadded.

    Returns ``[B, S]`` tensors (zeros at padding and at each row's first token) built from
    ``log_softmax(model(row).logits)`` gathered at the next token, the plain HF way.
    """
    rows, width = input_ids.shape
    logprobs = torch.zeros(rows, width)
    entropy = torch.zeros(rows, width)
    for b in range(rows):
        cols = attention_mask[b].nonzero().squeeze(1)
        ids = input_ids[b, cols].unsqueeze(0)
        logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        for k in range(1, cols.numel()):
            logprobs[b, cols[k]] = logp[k - 1, ids[0, k]]
            entropy[b, cols[k]] = -(logp[k - 1].exp() * logp[k - 1]).sum()
    return logprobs, entropy
