"""Decode-step attention that reads each prompt's keys and values once for all its samples.

A prompt sampled ``n`` times is prefilled once (:mod:`.running_batch`); if each of its ``n`` rows
held its own copy of the prompt's keys and values, every decode step would read that copy ``n``
times, and on a memory-bound CPU (or GPU) step the attention over long shared prompts then costs
more than the model's weights. The cache (:mod:`.kv_cache`) therefore keeps two stores per layer:

* the **prefix store**, ``[groups, kv_heads, prefix_width, head_dim]``: one entry per prefilled
  prompt (a *group*; left-padded, right-aligned at ``prefix_width``);
* the **suffix store**, ``[rows, kv_heads, capacity, head_dim]``: each row's generated tokens.

A decode step's attention (:func:`shared_prefix_attention`) scores a row's query against its
group's prefix and its own suffix, takes one softmax over both (so the result is ordinary
attention over prompt + completion), and sums the two weighted values. The prefix half runs as one
batched matmul per layer with the queries of a group's rows side by side (a group's rows are
padded to the largest group's row count), which is what reads each prefix once. This is the
"cascade" or shared-prefix attention of vLLM and FlashInfer, written with plain matmuls.

The layout travels to the attention function as the ``shared_prefix`` keyword of the model call:
transformers models pass extra keywords down to their attention function (as they do
flash-attention's). Prefill forwards and every other use of the model have no such keyword and
go to the model's own attention implementation unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME_PREFIX = "shared_prefix_"


@dataclass
class SharedPrefixStep:
    """What a decode step's attention needs besides its layer's suffix keys and values.

    ``prefix(layer)`` gives that layer's prefix store; row ``r`` belongs to group ``slots[r] //
    per_group`` and sits at place ``slots[r] % per_group`` among its group's rows. The biases are
    ``0`` where a row may attend and ``-inf`` elsewhere (``None``: no column is masked).
    ``dense``: every group has ``per_group`` rows and ``slots`` is ``0 .. rows - 1`` (``n``
    samples of each prompt in order, the common case), so no scatter or gather is needed.
    """

    prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor  # [rows]
    groups: int
    per_group: int
    prefix_bias: torch.Tensor | None  # [rows, 1, 1, prefix_width], float32
    suffix_bias: torch.Tensor | None  # [rows, 1, 1, capacity], float32
    dense: bool = False
    layers_seen: int = 0


def install(model) -> None:
    """Route ``model``'s attention through :func:`shared_prefix_attention` (its own implementation
    keeps every call that has no ``shared_prefix``, and its mask function)."""
    base = model.config._attn_implementation
    name = base if base.startswith(NAME_PREFIX) else NAME_PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _dispatching(base))
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base)
        if mask is not None:
            AttentionMaskInterface.register(name, mask)
    model.set_attn_implementation(name)


def _dispatching(base: str):
    """The attention function registered for ``base``: shared-prefix decode, else ``base``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        step = kwargs.pop("shared_prefix", None)
        if step is None:
            return _base(module, base)(module, query, key, value, attention_mask, **kwargs)
        step.layers_seen += 1
        prefix_keys, prefix_values = step.prefix(module.layer_idx)
        return shared_prefix_attention(
            query, key, value, prefix_keys, prefix_values, step, kwargs.get("scaling")
        )

    return attention


def _base(module, base: str):
    if base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    # "eager" is each modeling module's own function, not a registered one.
    return sys.modules[type(module).__module__].eager_attention_forward


def shared_prefix_attention(
    query: torch.Tensor,
    suffix_keys: torch.Tensor,
    suffix_values: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    step: SharedPrefixStep,
    scaling: float | None = None,
) -> tuple[torch.Tensor, None]:
    """One query token per row (``query [rows, heads, 1, head_dim]``) attending to its group's
    prefix and its own suffix; returns ``([rows, 1, heads, head_dim], None)`` as transformers'
    attention functions do. Grouped-query heads share their key/value head without copies."""
    rows, heads, q_len, dim = query.shape
    if q_len != 1:
        raise ValueError(f"shared-prefix attention decodes one token per row, got {q_len}")
    kv_heads = suffix_keys.shape[1]
    per_kv = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    # heads of one key/value head are consecutive; the scale goes on the (small) queries
    q = query.reshape(rows, kv_heads, per_kv, dim) * scale

    grouped = _to_groups(q, step)  # [groups, kv_heads, per_group * per_kv, dim]
    prefix_scores = _from_groups(grouped @ prefix_keys.transpose(-1, -2), step)
    suffix_scores = q @ suffix_keys.transpose(-1, -2)  # [rows, kv_heads, per_kv, suffix]
    width = prefix_scores.shape[-1]
    scores = torch.cat([prefix_scores, suffix_scores], dim=-1).float()
    if step.prefix_bias is not None:
        scores[..., :width] += step.prefix_bias
    if step.suffix_bias is not None:
        scores[..., width:] += step.suffix_bias[..., : suffix_scores.shape[-1]]
    weights = torch.softmax(scores, dim=-1).to(query.dtype)
    prefix_weights, suffix_weights = weights[..., :width], weights[..., width:]
    out = _from_groups(_to_groups(prefix_weights, step) @ prefix_values, step)
    out = out + suffix_weights @ suffix_values  # [rows, kv_heads, per_kv, dim]
    return out.reshape(rows, 1, heads, dim), None


def _to_groups(per_row: torch.Tensor, step: SharedPrefixStep) -> torch.Tensor:
    """``[rows, kv_heads, per_kv, x]`` -> ``[groups, kv_heads, per_group * per_kv, x]`` (zeros
    where a group has fewer rows than ``per_group``)."""
    _, kv_heads, per_kv, x = per_row.shape
    if step.dense:
        padded = per_row
    else:
        padded = per_row.new_zeros(step.groups * step.per_group, kv_heads, per_kv, x)
        padded[step.slots] = per_row
    padded = padded.view(step.groups, step.per_group, kv_heads, per_kv, x).transpose(1, 2)
    return padded.reshape(step.groups, kv_heads, step.per_group * per_kv, x)


def _from_groups(per_group: torch.Tensor, step: SharedPrefixStep) -> torch.Tensor:
    """The inverse of :func:`_to_groups`: each row's entries, ``[rows, kv_heads, per_kv, x]``."""
    groups, kv_heads, _, x = per_group.shape
    split = per_group.view(groups, kv_heads, step.per_group, -1, x).transpose(1, 2)
    per_slot = split.reshape(groups * step.per_group, kv_heads, -1, x)
    return per_slot if step.dense else per_slot[step.slots]
