"""verl's batches into the wire layout of DESIGN.md §3, and our per-token outputs back to verl's.

**What verl sends a forwarder.** A ``TensorDict`` whose ``input_ids`` is a nested (jagged) tensor of
the unpadded sequences, prompt then response. The prompts and responses are either dense (``[B, P]``
left-padded and ``[B, R]`` right-padded, with a dense ``attention_mask`` telling the real tokens:
verl 0.9's trainer) or nested (the TransferQueue trainers). The per-token training fields
(``response_mask``, ``advantages``, ``old_log_probs``, ``ref_log_prob``, ``rollout_is_weights``)
are *response-aligned*: entry ``k`` belongs to response token ``k``; dense ``[B, R]`` or nested.

**What the wire wants.** ``[B, S = P + R]`` tensors: each prompt left-padded to ``P``, each response
right-padded to ``R``, and every per-token field *position-indexed*: column ``i`` belongs to
``input_ids[:, i]``. Response token ``k`` of a row sits at column ``P + k``, so a response-aligned
field moves there, with zeros over the prompt part.

**What verl wants back.** ``fwd_no_grad`` returns position-indexed ``[B, S]`` log-probs (column
``i``: log-prob of token ``i`` given the tokens before it). verl wants, for each sequence, a nested
tensor over the whole unpadded sequence in *predict-next* order: entry ``j`` is the value for token
``j + 1`` (the output at position ``j``), the last entry 0. verl then slices
``values[L - resp_len - 1 : L - 1]`` as the response's values, which are exactly ours at columns
``P .. P + resp_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

# Per-token fields of a training batch, response-aligned in verl and position-indexed on the wire.
FLOAT_FIELDS = ("advantages", "old_log_probs", "ref_log_prob", "rollout_is_weights")


@dataclass(frozen=True)
class SequenceLayout:
    """Where each sequence's tokens sit: prompt and response lengths, and the padded widths."""

    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    prompt_width: int
    response_width: int

    @property
    def rows(self) -> int:
        return int(self.prompt_lens.shape[0])

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.response_lens

    @property
    def width(self) -> int:
        return self.prompt_width + self.response_width

    @property
    def offsets(self) -> torch.Tensor:
        """``[B + 1]`` start of each sequence in the flat (nested) values, then the total."""
        return torch.cat([self.seq_lens.new_zeros(1), self.seq_lens.cumsum(0)])

    @property
    def starts(self) -> torch.Tensor:
        """``[B]`` wire column of each sequence's first token."""
        return self.prompt_width - self.prompt_lens

    @classmethod
    def of(cls, data: TensorDict) -> SequenceLayout:
        """The layout of a verl batch (dense or nested prompts/responses, see the module doc)."""
        for name in ("input_ids", "prompts", "responses"):
            if name not in data:
                raise ValueError(f"batch.{name}: missing; verl batches carry it")
        prompts, responses = data["prompts"], data["responses"]
        if prompts.is_nested:
            prompt_lens = prompts.offsets().diff().long()
            response_lens = responses.offsets().diff().long()
            prompt_width = int(prompt_lens.max())
            response_width = max(int(response_lens.max()), 1)
        else:
            if "attention_mask" not in data:
                raise ValueError("batch.attention_mask: missing; dense prompts need it")
            mask = data["attention_mask"].long()
            prompt_width = int(prompts.shape[1])
            prompt_lens = mask[:, :prompt_width].sum(1)
            response_lens = mask[:, prompt_width:].sum(1)
            response_width = int(responses.shape[1])
        if (prompt_lens == 0).any():
            row = int((prompt_lens == 0).nonzero()[0, 0])
            raise ValueError(f"batch.prompts: row {row} has an empty prompt")
        layout = cls(prompt_lens, response_lens, prompt_width, response_width)
        input_ids = data["input_ids"]
        lengths = input_ids.offsets().diff() if input_ids.is_nested else None
        if lengths is not None and not torch.equal(lengths.long(), layout.seq_lens):
            raise ValueError(
                "batch.input_ids: sequence lengths disagree with the prompt and response lengths"
            )
        return layout

    def attention_mask(self) -> torch.Tensor:
        """``[B, S]`` int64: 1 on each row's columns ``[P - prompt_len, P + response_len)``."""
        columns = torch.arange(self.width).unsqueeze(0)
        start = self.starts.unsqueeze(1)
        end = (self.prompt_width + self.response_lens).unsqueeze(1)
        return ((columns >= start) & (columns < end)).long()

    def token_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For every flat token: its row, its index in its sequence, and its wire column."""
        rows = torch.repeat_interleave(torch.arange(self.rows), self.seq_lens)
        within = torch.arange(int(self.seq_lens.sum())) - self.offsets[:-1][rows]
        return rows, within, self.starts[rows] + within


def flat_values(tensor: torch.Tensor) -> torch.Tensor:
    """The concatenated values of a nested tensor (a flat tensor passes through)."""
    return tensor.values() if tensor.is_nested else tensor


def dense_tokens(data: TensorDict, layout: SequenceLayout, pad_token_id: int) -> torch.Tensor:
    """``[B, S]`` int64 ``input_ids``: prompts left-padded to ``P``, responses right-padded."""
    input_ids = data["input_ids"]
    if not input_ids.is_nested:
        raise ValueError("batch.input_ids: expected verl's nested (unpadded) sequences")
    values = flat_values(input_ids).long()
    out = torch.full((layout.rows, layout.width), pad_token_id, dtype=torch.long)
    rows, _, columns = layout.token_index()
    out[rows, columns] = values
    return out


def response_field(tensor: torch.Tensor, layout: SequenceLayout, name: str) -> torch.Tensor:
    """A response-aligned field (dense ``[B, R]`` or nested) position-indexed ``[B, S]``."""
    out = torch.zeros((layout.rows, layout.width), dtype=tensor.dtype)
    if tensor.is_nested:
        lengths = tensor.offsets().diff().long()
        if not torch.equal(lengths, layout.response_lens):
            raise ValueError(f"batch.{name}: lengths disagree with the responses' lengths")
        rows = torch.repeat_interleave(torch.arange(layout.rows), lengths)
        starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])[:-1]
        within = torch.arange(int(lengths.sum())) - starts[rows]
        out[rows, layout.prompt_width + within] = flat_values(tensor)
        return out
    if tensor.ndim != 2 or tensor.shape != (layout.rows, layout.response_width):
        raise ValueError(
            f"batch.{name}: expected [B, R] = [{layout.rows}, {layout.response_width}] "
            f"(response-aligned), got {list(tensor.shape)}"
        )
    out[:, layout.prompt_width :] = tensor
    return out


def wire_batch(
    data: TensorDict,
    layout: SequenceLayout,
    *,
    pad_token_id: int,
    fields: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """The DESIGN.md §3 batch of ``data``: tokens, masks and the named per-token ``fields``.

    ``fields`` may name ``response_mask`` and any of :data:`FLOAT_FIELDS`; each must be in
    ``data``. Float fields travel as float32, masks and ids as int64. ``position_ids`` are left
    out: the engines rebuild them from ``attention_mask``.
    """
    input_ids = dense_tokens(data, layout, pad_token_id)
    batch = {
        "input_ids": input_ids,
        "attention_mask": layout.attention_mask(),
        "prompts": input_ids[:, : layout.prompt_width].clone(),
        "responses": input_ids[:, layout.prompt_width :].clone(),
    }
    for name in fields:
        if name not in data:
            raise ValueError(f"batch.{name}: missing; the update needs it")
        value = response_field(data[name], layout, name)
        dtype = torch.long if name == "response_mask" else torch.float32
        batch[name] = value.to(dtype)
    return batch


def predict_next(values: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Position-indexed ``[B, S]`` values as verl's nested predict-next sequences (module doc)."""
    if values.shape != (layout.rows, layout.width):
        raise ValueError(
            f"expected [B, S] = [{layout.rows}, {layout.width}] position-indexed values, "
            f"got {list(values.shape)}"
        )
    rows, within, columns = layout.token_index()
    has_next = within < (layout.seq_lens[rows] - 1)
    following = values[rows, torch.clamp(columns + 1, max=layout.width - 1)]
    flat = torch.where(has_next, following, torch.zeros((), dtype=values.dtype))
    return torch.nested.nested_tensor_from_jagged(flat.contiguous(), offsets=layout.offsets)
