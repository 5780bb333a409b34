"""GRPO advantages for client-side loops, in numpy only.

A driver that talks to a remote engine computes advantages itself, usually in a process without
torch, so this module imports numpy and nothing heavier. The numbers match verl's
``compute_grpo_outcome_advantage``: a sample's score is the sum of its rewards, groups are samples
that share a group id (verl's ``uid``), the group's spread is the unbiased standard deviation
(``torch.std``), and a group of one sample gets mean 0 and standard deviation 1.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def grpo_advantages(
    rewards,
    group_ids: Sequence[Hashable] | None = None,
    *,
    group_size: int | None = None,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> np.ndarray:
    """Group-normalised advantage of each sample, float32 ``[B]``.

    ``rewards`` is ``[B]`` (one score per sample) or ``[B, T]`` token-level rewards, which are
    summed per sample as verl does. Groups come from ``group_ids`` (any hashable per sample) or from
    ``group_size`` (consecutive runs of that many samples, the layout ``n`` samples per prompt
    produce); give exactly one. ``A = (s - mean) / (std + epsilon)``, or ``s - mean`` when
    ``norm_by_std`` is false (Dr. GRPO).
    """
    scores = _scores(rewards)
    groups = _group_index(len(scores), group_ids, group_size)
    if not np.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon: must be a finite number >= 0, got {epsilon!r}")
    advantages = np.empty_like(scores)
    for members in groups:
        values = scores[members]
        if len(values) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = values.mean(), values.std(ddof=1)
        centred = values - mean
        advantages[members] = centred / (std + epsilon) if norm_by_std else centred
    return advantages.astype(np.float32)


def broadcast_to_tokens(advantages, response_mask) -> np.ndarray:
    """Spread a per-sample advantage ``[B]`` over its tokens: ``A[b] * response_mask[b, t]``.

    The result has the mask's shape (``[B, S]`` in the verl layout, zeros over the prompt), float32,
    ready to send as the batch's ``advantages``.
    """
    adv = np.asarray(advantages, dtype=np.float64)
    mask = np.asarray(response_mask)
    if adv.ndim != 1:
        raise ValueError(f"advantages: expected shape [B], got {list(adv.shape)}")
    if mask.ndim != 2 or mask.shape[0] != adv.shape[0]:
        raise ValueError(
            f"response_mask: expected shape [{adv.shape[0]}, S], got {list(mask.shape)}"
        )
    return (adv[:, None] * mask.astype(np.float64)).astype(np.float32)


def _scores(rewards) -> np.ndarray:
    try:
        values = np.asarray(rewards, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rewards: not numeric ({exc})") from exc
    if values.ndim == 2:
        values = values.sum(axis=1)
    if values.ndim != 1 or values.shape[0] == 0:
        raise ValueError(f"rewards: expected shape [B] or [B, T] with B >= 1, got {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("rewards: contains NaN or infinity")
    return values


def _group_index(n: int, group_ids, group_size: int | None) -> list[np.ndarray]:
    """Indices of each group's members, in order of first appearance."""
    if (group_ids is None) == (group_size is None):
        raise ValueError("group_ids/group_size: give exactly one of them")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
            raise ValueError(f"group_size: expected an integer, got {group_size!r}")
        if group_size < 1 or n % group_size:
            raise ValueError(f"group_size: {group_size} does not divide the {n} samples")
        return [np.arange(i, i + group_size) for i in range(0, n, group_size)]
    ids = group_ids.tolist() if hasattr(group_ids, "tolist") else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids: expected {n} ids (one per sample), got {len(ids)}")
    members: dict[Hashable, list[int]] = {}
    for i, gid in enumerate(ids):
        try:
            members.setdefault(gid, []).append(i)
        except TypeError as exc:
            raise ValueError(f"group_ids[{i}]: not hashable ({gid!r})") from exc
    return [np.asarray(idx) for idx in members.values()]
