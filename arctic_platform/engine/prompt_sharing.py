"""Prompt sharing: run each distinct prompt once for all the responses sampled from it.

GRPO samples every prompt ``n`` times, and each of the ``n`` rows of a training batch repeats the
prompt. Scoring row by row runs the prompt's tokens ``n`` times; with long prompts and short
responses most of the model's work is those repeats. Here rows with the same prompt form a
*group*, and a :class:`SharedMicroBatch` scores groups in two model calls:

1. **prefix pass**: each group's prompt, less its last token, once (``[g, P]``, right-padded),
   with the model's key/value cache on;
2. **suffix pass**: every row's last prompt token and response (``[rows, L]``, right-padded),
   attending to its group's cached prompt keys/values, which are indexed out of the prefix cache
   per row. Position ids continue from the prompt's end, as in the row's own sequence.

Prompt keys and values are a causal function of the prompt alone, so every row's tokens see
exactly what the naive per-row pass gives them, and autograd sums the gradients the rows send into
the shared prefix (the index that copies the cache to the rows is differentiable) — the naive
pass's gradient, up to float rounding. The last prompt token travels with each row because its
output predicts that row's first response token.

A row's prompt is its real tokens before the response: before column ``P`` when the batch has
verl's ``prompts`` ``[B, P]`` (the layout our client and verl send), else before the first set
``response_mask`` (or ``loss_mask``, or ECHO's ``sft_mask``) column. Rows share when their prompt
tokens *and* the targets scored over the prompt are equal (targets are the tokens themselves for
RL batches).

``prompt_sharing: auto`` uses the shared layout when it saves model work: when the planned shared
microbatches process at most :data:`MAX_SHARED_COST` of the tokens today's padding-free path
processes. ``off`` is today's path, bit for bit. Sharing needs the model's key/value cache, so it
is off under gradient checkpointing (which turns the cache off) and with FSDP (whose per-forward
parameter gathers must match across ranks call for call).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from arctic_platform.engine.batching import Batch, MicroBatch, plan_microbatches
from arctic_platform.engine.config import PromptSharing

# auto shares prompts when the shared plan's model tokens are at most this fraction of the real
# tokens the padding-free path processes (the rest pays for the two-pass overhead and the cache
# attention the suffix pass computes densely). Measured in benchmarks/engine_train.py.
MAX_SHARED_COST = 0.85

# Metric pair reported by every scoring call: prompt tokens not recomputed / real tokens.
SAVED_METRIC = "prompt_tokens_saved_fraction"


@dataclass(frozen=True)
class PromptGroups:
    """Rows grouped by shared prompt (batch order), each group's prompt length, the tokens saved.

    ``groups`` holds every row once; a row whose prompt is shared with no other row (or has fewer
    than two prompt tokens) is a group of one.
    """

    groups: list[list[int]]
    prompt_lengths: list[int]

    @property
    def shared(self) -> list[int]:
        """Indices of the groups with more than one row."""
        return [i for i, rows in enumerate(self.groups) if len(rows) > 1]

    def saved(self, k: int) -> int:
        """Prompt tokens group ``k`` does not recompute when shared: ``(n - 1) * (p - 1)``."""
        return (len(self.groups[k]) - 1) * (self.prompt_lengths[k] - 1)

    @property
    def saved_tokens(self) -> int:
        """Prompt tokens the shared layout does not recompute, over all groups."""
        return sum(self.saved(k) for k in self.shared)


def response_starts(tensors: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor | None:
    """Per row, the first column of the response (see module doc); None when unknown."""
    size, seq_len = mask.shape
    if "prompts" in tensors:
        return torch.full((size,), int(tensors["prompts"].shape[1]), dtype=torch.long)
    for name in ("response_mask", "loss_mask"):
        if name in tensors:
            marked = tensors[name].bool()
            if "sft_mask" in tensors:  # ECHO's targets are scored too: they are not prompt
                marked = marked | tensors["sft_mask"].bool()
            cols = torch.arange(seq_len).expand(size, seq_len)
            return torch.where(marked, cols, seq_len).min(1).values
    return None


def find_prompt_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    starts: torch.Tensor,
    rows: list[int],
) -> PromptGroups:
    """Group ``rows`` by their prompt tokens and the targets scored over the prompt."""
    by_key: dict[tuple, int] = {}
    groups: list[list[int]] = []
    lengths: list[int] = []
    for i in rows:
        cols = attention_mask[i].nonzero().squeeze(1)
        prompt_cols = cols[cols < int(starts[i])]
        p = int(prompt_cols.numel())
        key = None
        if p >= 2:
            key = (
                tuple(input_ids[i, prompt_cols].tolist()),
                tuple(targets[i, prompt_cols[1:]].tolist()),
            )
        if key is not None and key in by_key:
            groups[by_key[key]].append(i)
            continue
        if key is not None:
            by_key[key] = len(groups)
        groups.append([i])
        lengths.append(p)
    return PromptGroups(groups=groups, prompt_lengths=lengths)


@dataclass(frozen=True)
class SharedMicroBatch:
    """Groups of rows that share prompts, scored in a prefix and a suffix pass (module doc).

    Outputs live in a flat *virtual* layout ``[1, N]``: the prefix pass's ``[g, P]`` positions,
    then the suffix pass's ``[rows, L]``. ``targets``, ``token_rows``, ``token_cols`` and
    ``pred_index`` mean what they mean on :class:`~arctic_platform.engine.batching.MicroBatch`;
    a shared prompt position's index appears once for every row of its group.
    """

    rows: torch.Tensor
    prefix_ids: torch.Tensor
    prefix_positions: torch.Tensor
    prefix_mask: torch.Tensor | None
    suffix_ids: torch.Tensor
    suffix_positions: torch.Tensor
    suffix_mask: torch.Tensor | None
    group_index: torch.Tensor
    targets: torch.Tensor
    token_rows: torch.Tensor
    token_cols: torch.Tensor
    pred_index: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Tokens the model processes in both passes (padding included)."""
        return int(self.prefix_ids.numel() + self.suffix_ids.numel())

    def to(self, device: torch.device) -> SharedMicroBatch:
        moved = {
            name: None if value is None else value.to(device)
            for name, value in vars(self).items()
            if name != "rows"
        }
        return replace(self, **moved)

    def model_outputs(self, model: torch.nn.Module) -> torch.Tensor:
        """Both passes; their ``logits`` outputs ``[1, N, V]`` in the virtual layout (``[1, N, H]``,
        the head's input, while :meth:`~arctic_platform.engine.chunked_head.LMHead.bypassed`)."""
        prefix = model(
            input_ids=self.prefix_ids,
            attention_mask=self.prefix_mask,
            position_ids=self.prefix_positions,
            use_cache=True,
        )
        cache = prefix.past_key_values
        cache.batch_select_indices(self.group_index)
        suffix = model(
            input_ids=self.suffix_ids,
            attention_mask=self.suffix_mask,
            position_ids=self.suffix_positions,
            past_key_values=cache,
            use_cache=True,
        )
        width = prefix.logits.shape[-1]
        flat = torch.cat([prefix.logits.reshape(-1, width), suffix.logits.reshape(-1, width)])
        return flat.unsqueeze(0)


def shared_microbatch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    groups: list[list[int]],
    prompt_lengths: list[int],
) -> SharedMicroBatch:
    """Lay out ``groups`` (with their prompt lengths) as one :class:`SharedMicroBatch`."""
    rows = [i for group in groups for i in group]
    real = {i: attention_mask[i].nonzero().squeeze(1) for i in rows}
    g = len(groups)
    prefix_width = max(prompt_lengths) - 1
    suffix_width = max(
        real[i].numel() - prompt_lengths[k] + 1 for k, grp in enumerate(groups) for i in grp
    )
    prefix_ids = torch.zeros(g, prefix_width, dtype=torch.long)
    prefix_mask = torch.zeros(g, prefix_width, dtype=torch.long)
    suffix_ids = torch.zeros(len(rows), suffix_width, dtype=torch.long)
    suffix_mask = torch.zeros(len(rows), suffix_width, dtype=torch.long)
    suffix_positions = torch.zeros(len(rows), suffix_width, dtype=torch.long)
    group_index = torch.zeros(len(rows), dtype=torch.long)
    flat_targets = torch.zeros(g * prefix_width + len(rows) * suffix_width, dtype=torch.long)
    token_rows, token_cols, pred_index = [], [], []
    suffix_base = g * prefix_width
    local = 0
    for k, group in enumerate(groups):
        p = prompt_lengths[k]
        first = real[group[0]]
        prefix_ids[k, : p - 1] = input_ids[group[0], first[: p - 1]]
        prefix_mask[k, : p - 1] = 1
        # Prompt tokens 1..p-1 are predicted by prefix positions 0..p-2, shared by the group.
        prompt_pred = torch.arange(p - 1) + k * prefix_width
        flat_targets[prompt_pred] = targets[group[0], first[1:p]]
        for i in group:
            cols = real[i]
            length = cols.numel() - p + 1
            suffix_ids[local, :length] = input_ids[i, cols[p - 1 :]]
            suffix_mask[local, :length] = 1
            suffix_positions[local] = torch.arange(p - 1, p - 1 + suffix_width)
            group_index[local] = k
            # Response tokens are predicted by the suffix position before them.
            response_pred = torch.arange(length - 1) + suffix_base + local * suffix_width
            flat_targets[response_pred] = targets[i, cols[p:]]
            token_rows.append(torch.full((cols.numel() - 1,), local, dtype=torch.long))
            token_cols.append(cols[1:])
            pred_index.append(torch.cat([prompt_pred, response_pred]))
            local += 1
    suffix_full = torch.cat([prefix_mask.index_select(0, group_index), suffix_mask], dim=1)
    return SharedMicroBatch(
        rows=torch.tensor(rows),
        prefix_ids=prefix_ids,
        prefix_positions=torch.arange(prefix_width).expand(g, prefix_width).contiguous(),
        prefix_mask=None if bool(prefix_mask.all()) else prefix_mask,
        suffix_ids=suffix_ids,
        suffix_positions=suffix_positions,
        suffix_mask=None if bool(suffix_full.all()) else suffix_full,
        group_index=group_index,
        targets=flat_targets.unsqueeze(0),
        token_rows=torch.cat(token_rows),
        token_cols=torch.cat(token_cols),
        pred_index=torch.cat(pred_index),
    )


def plan_shared(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    prompt_groups: PromptGroups,
    *,
    max_tokens: int,
) -> list[SharedMicroBatch]:
    """Shared microbatches for the groups of more than one row, never splitting a group.

    Groups are taken longest prompt first and stacked while the padded tokens of both passes fit
    ``max_tokens``; a group over the budget gets a microbatch of its own.
    """
    lengths = attention_mask.sum(1)
    order = sorted(prompt_groups.shared, key=lambda k: (-prompt_groups.prompt_lengths[k], k))
    plans: list[list[int]] = []
    for k in order:
        if plans and _cost(plans[-1] + [k], prompt_groups, lengths) <= max_tokens:
            plans[-1].append(k)
        else:
            plans.append([k])
    return [
        shared_microbatch(
            input_ids,
            attention_mask,
            targets,
            [prompt_groups.groups[k] for k in plan],
            [prompt_groups.prompt_lengths[k] for k in plan],
        )
        for plan in plans
    ]


def _cost(plan: list[int], prompt_groups: PromptGroups, lengths: torch.Tensor) -> int:
    """Padded model tokens of both passes for the groups ``plan``."""
    prefix = max(prompt_groups.prompt_lengths[k] for k in plan) - 1
    rows = [(i, prompt_groups.prompt_lengths[k]) for k in plan for i in prompt_groups.groups[k]]
    suffix = max(int(lengths[i]) - p + 1 for i, p in rows)
    return len(plan) * prefix + len(rows) * suffix


def plan_request(
    batch: Batch,
    targets: torch.Tensor,
    *,
    max_tokens: int,
    packing: bool,
    prompt_sharing: PromptSharing,
) -> tuple[list[MicroBatch | SharedMicroBatch], PromptGroups | None]:
    """The microbatches of a request and, when they share prompts, the groups they share.

    With ``prompt_sharing="off"``, or when no rows share a prompt, or when sharing would not save
    work (module doc), this is :func:`plan_microbatches` on the whole batch. Otherwise the groups
    of more than one row get shared microbatches and the other rows are planned as usual.
    """
    groups = None
    if prompt_sharing != "off" and batch.standard_positions:
        starts = response_starts(batch.tensors, batch.attention_mask)
        if starts is not None:
            groups = find_prompt_groups(
                batch.input_ids, batch.attention_mask, targets, starts, list(range(batch.size))
            )
    if groups is not None and groups.shared:
        shared = plan_shared(
            batch.input_ids, batch.attention_mask, targets, groups, max_tokens=max_tokens
        )
        shared_rows = [i for k in groups.shared for i in groups.groups[k]]
        naive_tokens = int(batch.lengths[shared_rows].sum())
        if sum(mb.num_tokens for mb in shared) <= MAX_SHARED_COST * naive_tokens:
            alone = sorted(set(range(batch.size)) - set(shared_rows))
            rest = plan_microbatches(
                batch, targets, max_tokens=max_tokens, packing=packing, rows=alone
            )
            return [*shared, *rest], groups
    return plan_microbatches(batch, targets, max_tokens=max_tokens, packing=packing), None
