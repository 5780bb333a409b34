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
batched matmul per layer with the queries of a group's rows side by side (in chunks of equal
size, see :func:`layout`), which is what reads each prefix once. This is the "cascade" or
shared-prefix attention of vLLM and FlashInfer, written with plain matmuls.

The layout travels to the attention function as the ``shared_prefix`` keyword of the model call:
transformers models pass extra keywords down to their attention function (as they do
flash-attention's). Prefill forwards and every other use of the model have no such keyword and
go to the model's own attention implementation (``sdpa`` where that was a flash-attention,
paged or hub-kernel one, which transformers resolves by its exact name).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from arctic_platform.engine.errors import UnsupportedModel

log = logging.getLogger(__name__)

NAME_PREFIX = "shared_prefix_"
# Prefill implementations the wrapper can keep: transformers resolves every other one (flash
# attention, paged, hub kernels) by its exact name, which a wrapper's name is not.
KEPT_BASES = ("sdpa", "eager")
# Attention keywords that change the result and that decode here does not apply.
UNSUPPORTED_KEYWORDS = ("softcap", "s_aux", "sliding_window")


@dataclass(frozen=True)
class Level:
    """Some rows scoring their prompts' prefixes in one batched matmul: row ``rows[i]`` (every
    row, in order, when ``rows`` is None) sits at place ``slots[i] % per_chunk`` of chunk
    ``slots[i] // per_chunk``, and chunk ``c`` reads prefix group ``chunk_groups[c]`` (``c``
    itself when None). ``dense``: the slots are ``0 .. len - 1``, no scatter or gather."""

    rows: torch.Tensor | None
    slots: torch.Tensor
    chunks: int
    per_chunk: int
    chunk_groups: torch.Tensor | None
    dense: bool


@dataclass
class SharedPrefixStep:
    """What a decode step's attention needs besides its layer's suffix keys and values: the
    prefix store (``prefix(layer)``), the :class:`Level` s its rows score their prefixes in, and
    the biases (``0`` where a row may attend, ``-inf`` elsewhere; ``None``: no column masked).
    Build it with :func:`layout`."""

    prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None
    levels: list[Level]
    prefix_bias: torch.Tensor | None  # [rows, 1, 1, prefix_width], float32
    suffix_bias: torch.Tensor | None  # [rows, 1, 1, capacity], float32
    layers_seen: int = 0


def layout(
    group: torch.Tensor,
    groups: int,
    prefix: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    prefix_bias: torch.Tensor | None,
    suffix_bias: torch.Tensor | None,
) -> SharedPrefixStep:
    """The step for rows whose prompts are ``group`` (each of ``0 .. groups - 1`` has a row).

    One level holds every row, each group padded to the largest one's rows, unless that would
    more than double the query slots (one large group among many small ones, as joins and
    compaction leave them): then a level takes the first median-size rows of every group, and
    the rest of the larger groups go to further levels (reading their prefixes by a gather), so
    the padding stays bounded and each prefix is read about once, never once per row."""
    device = group.device
    sizes = torch.bincount(group, minlength=groups)
    order = torch.argsort(group, stable=True)
    place = torch.empty_like(group)
    place[order] = torch.arange(len(group), device=device) - (
        torch.cumsum(sizes, 0) - sizes
    ).repeat_interleave(sizes)
    levels: list[Level] = []
    rows = torch.arange(len(group), device=device)
    while len(rows):
        sizes = torch.bincount(group, minlength=groups)
        present = sizes.nonzero().squeeze(1)
        largest = int(sizes.max())
        last = len(present) * largest <= 2 * len(rows)
        per_chunk = largest if last else int(sizes[present].sort().values[(len(present) - 1) // 2])
        here = place < per_chunk
        slots = torch.searchsorted(present, group[here]) * per_chunk + place[here]
        every = bool(here.all()) and not levels
        levels.append(
            Level(
                rows=None if every else rows[here],
                slots=slots,
                chunks=len(present),
                per_chunk=per_chunk,
                chunk_groups=None if len(present) == groups else present,
                dense=len(present) * per_chunk == len(slots)
                and bool((slots == torch.arange(len(slots), device=device)).all()),
            )
        )
        rows, group, place = rows[~here], group[~here], place[~here] - per_chunk
    return SharedPrefixStep(prefix, levels, prefix_bias, suffix_bias)


def install(model) -> None:
    """Route ``model``'s attention through :func:`shared_prefix_attention` (its own implementation
    keeps every call that has no ``shared_prefix``, and its mask function)."""
    base = model.config._attn_implementation
    if base.startswith(NAME_PREFIX):
        return
    if base not in KEPT_BASES:
        log.info("sampler prefill attention: %s -> sdpa (decode is shared-prefix)", base)
        base = "sdpa"
    name = NAME_PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _dispatching(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)


def _dispatching(base: str):
    """The attention function registered for ``base``: shared-prefix decode, else ``base``."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        step = kwargs.pop("shared_prefix", None)
        if step is None:
            return _base(module, base)(module, query, key, value, attention_mask, **kwargs)
        used = [name for name in UNSUPPORTED_KEYWORDS if kwargs.get(name) is not None]
        if used:
            raise UnsupportedModel(
                f"{type(module).__name__} passes {', '.join(used)} to its attention, which the "
                "sampler's shared-prefix decode does not apply"
            )
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
    attention functions do. Grouped-query heads share their key/value head without copies.
    Scores and softmax are float32 whatever the model's dtype (as fused attention keeps them);
    the weighted sums of values run in the model's dtype."""
    rows, heads, q_len, dim = query.shape
    if q_len != 1:
        raise ValueError(f"shared-prefix attention decodes one token per row, got {q_len}")
    kv_heads = suffix_keys.shape[1]
    per_kv = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    # heads of one key/value head are consecutive; the scale goes on the (small) queries
    q = query.reshape(rows, kv_heads, per_kv, dim).float() * scale
    stores = [_prefixes(level, prefix_keys, prefix_values) for level in step.levels]
    prefix_scores = _per_level(
        q,
        step,
        lambda level, queries, store: _from_chunks(
            _to_chunks(queries, level) @ store[0].float().transpose(-1, -2), level
        ),
        stores,
    )
    suffix_scores = q @ suffix_keys.float().transpose(-1, -2)  # [rows, kv_heads, per_kv, suffix]
    width = prefix_scores.shape[-1]
    scores = torch.cat([prefix_scores, suffix_scores], dim=-1)
    if step.prefix_bias is not None:
        scores[..., :width] += step.prefix_bias
    if step.suffix_bias is not None:
        scores[..., width:] += step.suffix_bias[..., : suffix_scores.shape[-1]]
    weights = torch.softmax(scores, dim=-1).to(query.dtype)
    prefix_weights, suffix_weights = weights[..., :width], weights[..., width:]
    out = _per_level(
        prefix_weights,
        step,
        lambda level, part, store: _from_chunks(_to_chunks(part, level) @ store[1], level),
        stores,
    )
    out = out + suffix_weights @ suffix_values  # [rows, kv_heads, per_kv, dim]
    return out.reshape(rows, 1, heads, dim), None


def _prefixes(level: Level, keys: torch.Tensor, values: torch.Tensor):
    """The prefix keys and values ``level``'s chunks read, in chunk order."""
    if level.chunk_groups is None:
        return keys, values
    return keys.index_select(0, level.chunk_groups), values.index_select(0, level.chunk_groups)


def _per_level(per_row: torch.Tensor, step: SharedPrefixStep, compute, stores) -> torch.Tensor:
    """``compute(level, its rows of per_row, its prefixes)`` for each level, back in row order."""
    if len(step.levels) == 1:
        return compute(step.levels[0], per_row, stores[0])
    out = None
    for level, store in zip(step.levels, stores, strict=True):
        part = compute(level, per_row[level.rows], store)
        if out is None:
            out = part.new_empty(per_row.shape[:-1] + part.shape[-1:])
        out[level.rows] = part
    return out


def _to_chunks(per_row: torch.Tensor, level: Level) -> torch.Tensor:
    """``[rows, kv_heads, per_kv, x]`` -> ``[chunks, kv_heads, per_chunk * per_kv, x]`` (zeros
    where a chunk has fewer rows than ``per_chunk``)."""
    _, kv_heads, per_kv, x = per_row.shape
    if level.dense:
        padded = per_row
    else:
        padded = per_row.new_zeros(level.chunks * level.per_chunk, kv_heads, per_kv, x)
        padded[level.slots] = per_row
    padded = padded.view(level.chunks, level.per_chunk, kv_heads, per_kv, x).transpose(1, 2)
    return padded.reshape(level.chunks, kv_heads, level.per_chunk * per_kv, x)


def _from_chunks(per_chunk: torch.Tensor, level: Level) -> torch.Tensor:
    """The inverse of :func:`_to_chunks`: each row's entries, ``[rows, kv_heads, per_kv, x]``."""
    chunks, kv_heads, _, x = per_chunk.shape
    split = per_chunk.view(chunks, kv_heads, level.per_chunk, -1, x).transpose(1, 2)
    per_slot = split.reshape(chunks * level.per_chunk, kv_heads, -1, x)
    return per_slot if level.dense else per_slot[level.slots]
