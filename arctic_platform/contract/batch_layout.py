"""The per-token fields of a training batch, as every side names them.

The engine reads these fields (``engine/batching.py``) and the API edges that build batches
themselves (the Tinker datums in ``server/tinker/losses.py``) write them; both take the names and
the no-target label from here, so neither needs the other's imports (the server's edges stay
free of torch).
"""

from __future__ import annotations

# Per-token float fields of the verl layout: [B, S], zeros over the prompt; ``loss_weights`` scales
# each token's cross-entropy term (Tinker's ``weights``).
FLOAT_FIELDS = ("advantages", "old_log_probs", "ref_log_prob", "rollout_is_weights", "loss_weights")
# Per-token 0/1 masks of the verl layout, and ECHO's (losses/cortex_grpo_echo.py): [B, S].
MASK_FIELDS = ("response_mask", "loss_mask", "sft_mask", "echo_observation_mask")
# Label value that marks a position without a target (HF convention).
IGNORE_INDEX = -100
