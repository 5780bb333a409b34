"""Build the verl-layout training batch (DESIGN.md §3) from prompts and sampled responses.

Every RL loop that drives the client does the same packing: prompts left-padded to ``P``,
responses right-padded to ``R``, and the per-token fields (``response_mask``, ``advantages``,
``old_log_probs``, ...) as ``[B, P + R]`` arrays that are zero over the prompt part. Doing it here
once keeps recipes short and gets the alignment right: column ``i`` of every per-token field
belongs to token ``input_ids[:, i]``, which is also how ``fwd_no_grad`` returns log-probs, so they
can be passed back as ``old_log_probs`` unchanged.

numpy only: a driver with the ``client`` extra (no torch) can use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from arctic_platform.advantages import broadcast_to_tokens


def training_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    advantages: Sequence[float] | None = None,
) -> dict[str, np.ndarray]:
    """The ``[B, P+R]`` batch for ``B`` (prompt, response) pairs.

    ``advantages`` holds one scalar per sample (e.g. from
    :func:`arctic_platform.advantages.grpo_advantages`); it is broadcast over the sample's
    response tokens. Returns int64 ``input_ids``, ``attention_mask``, ``position_ids``,
    ``prompts`` ``[B,P]``, ``responses`` ``[B,R]``, ``response_mask``, and float32
    ``advantages`` when given.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            f"response_ids: {len(response_ids)} responses for {len(prompt_ids)} prompts"
        )
    if not prompt_ids:
        raise ValueError("prompt_ids: no samples")
    if advantages is not None and len(advantages) != len(prompt_ids):
        raise ValueError(f"advantages: {len(advantages)} values for {len(prompt_ids)} samples")
    rows = len(prompt_ids)
    width_p = max(len(p) for p in prompt_ids)
    width_r = max(1, max(len(r) for r in response_ids))
    input_ids = np.full((rows, width_p + width_r), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((rows, width_p + width_r), dtype=np.int64)
    response_mask = np.zeros((rows, width_p + width_r), dtype=np.int64)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        if not prompt:
            raise ValueError(f"prompt_ids[{i}]: empty prompt")
        start = width_p - len(prompt)
        input_ids[i, start:width_p] = prompt
        input_ids[i, width_p : width_p + len(response)] = response
        attention_mask[i, start : width_p + len(response)] = 1
        response_mask[i, width_p : width_p + len(response)] = 1
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None) * attention_mask
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids.astype(np.int64),
        "prompts": input_ids[:, :width_p].copy(),
        "responses": input_ids[:, width_p:].copy(),
        "response_mask": response_mask,
    }
    if advantages is not None:
        batch["advantages"] = broadcast_to_tokens(advantages, response_mask)
    return batch
