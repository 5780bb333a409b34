"""Validate a verl-layout batch and cut it into microbatches by a token budget.

A batch arrives as a dict of ``[B, S]`` tensors (torch or numpy). :func:`validate_batch` checks
every known field's shape, dtype and values before the engine touches any state, so bad input fails
with an :class:`EngineInputError` naming the field and nothing else changes.

:func:`plan_microbatches` then decides how the model sees the rows:

* **packed** (the default whenever sequence lengths vary): padding is stripped and whole sequences
  are packed first-fit-decreasing into rows no longer than the longest sequence (nor the budget),
  with position ids that restart at 0 for each sequence and ``attention_mask=None``. transformers
  detects the restarts and builds a block-diagonal causal mask, so packed sequences never see each
  other. Rows are capped at the longest sequence because sdpa computes attention over a whole row,
  masked blocks included: a row as long as the budget would cost more attention than padding did.
  Rows of similar fill are then stacked ``[k, W]`` into one microbatch while ``k x W`` fits the
  budget and row-tail padding stays under 10%; a row's tail is a dummy segment nothing attends to.
* **padded**: consecutive rows are grouped while ``rows x span`` stays within the budget, each group
  trimmed to the columns its rows actually use. Used when packing is off, when all lengths are equal
  (packing would only add mask work), or when the caller sent non-standard ``position_ids``
  (packing needs positions that restart at 0).

A sequence longer than the budget gets a microbatch of its own; rows are never split, so losses that
average per sequence see whole sequences.

Whatever the layout, a :class:`MicroBatch` records, for every scored token (each real token except
a sequence's first, which has no context), which original ``(row, column)`` it is and which
model-output position predicts it. That index turns model outputs back into the position-indexed
``[B, S]`` layout exactly, including masks with holes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from arctic_platform import wire
from arctic_platform.contract.batch_layout import FLOAT_FIELDS, IGNORE_INDEX, MASK_FIELDS
from arctic_platform.contract.bodies import longest_row_problem
from arctic_platform.engine.errors import EngineInputError


@dataclass(frozen=True)
class Batch:
    """A validated batch: CPU tensors with consistent shapes, plus what microbatching needs.

    ``position_ids`` is the caller's, or rebuilt from the mask (``cumsum - 1`` clamped at 0).
    ``standard_positions`` says whether the positions of real tokens are ``0..L-1`` per row, the
    precondition for packing.
    """

    tensors: dict[str, torch.Tensor]
    position_ids: torch.Tensor
    standard_positions: bool

    @property
    def size(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tensors["input_ids"].shape[1])

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tensors["input_ids"]

    @property
    def attention_mask(self) -> torch.Tensor:
        """Boolean ``[B, S]``: True on real tokens."""
        return self.tensors["attention_mask"]

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(1)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def require(self, name: str, why: str) -> torch.Tensor:
        """The field ``name``, or an EngineInputError saying who needs it."""
        if name not in self.tensors:
            raise EngineInputError(f"batch.{name}", f"missing; {why}")
        return self.tensors[name]

    def first_tokens(self) -> torch.Tensor:
        """Boolean ``[B, S]``: True at each row's first real token (it has no log-prob)."""
        mask = self.attention_mask
        return mask & (mask.long().cumsum(1) == 1)

    def scorable(self) -> torch.Tensor:
        """Boolean ``[B, S]``: real tokens that have a log-prob (all but each row's first)."""
        return self.attention_mask & ~self.first_tokens()

    def check_loss_mask(self, name: str, mask: torch.Tensor) -> None:
        """A loss mask may only select tokens that have a log-prob."""
        on_pad = mask & ~self.attention_mask
        if on_pad.any():
            row = int(on_pad.any(1).nonzero()[0, 0])
            raise EngineInputError(
                f"batch.{name}", f"selects padded positions (attention_mask=0), e.g. in row {row}"
            )
        on_first = mask & self.first_tokens()
        if on_first.any():
            row = int(on_first.any(1).nonzero()[0, 0])
            raise EngineInputError(
                f"batch.{name}",
                f"selects the first token of row {row}, which has no log-prob; per-token fields "
                "are position-indexed (column i belongs to input_ids[:, i])",
            )

    def check_finite(self, name: str, where: torch.Tensor) -> None:
        """Field ``name`` must be finite wherever ``where`` is True."""
        bad = ~torch.isfinite(self.tensors[name]) & where
        if bad.any():
            row, col = (int(v) for v in bad.nonzero()[0])
            raise EngineInputError(
                f"batch.{name}", f"NaN or infinity at a used position (row {row}, column {col})"
            )


def validate_batch(
    batch: Mapping, *, vocab_size: int | None = None, max_seq_len: int | None = None
) -> Batch:
    """Convert and check every known field of ``batch``; unknown keys are ignored.

    Raises :class:`EngineInputError` naming the field for a missing ``input_ids`` or
    ``attention_mask``, a wrong shape or dtype, mask values other than 0/1, an empty row, a row
    with more real tokens than ``max_seq_len`` (the model's context), token ids outside the
    vocabulary, or labels on padded positions.
    """
    if not isinstance(batch, Mapping):
        raise EngineInputError("batch", f"expected a dict of tensors, got {type(batch).__name__}")
    tensors: dict[str, torch.Tensor] = {}

    input_ids = _integer(batch, "input_ids", required=True)
    if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise EngineInputError(
            "batch.input_ids", f"expected [B, S] with B, S >= 1, got {_shape(input_ids)}"
        )
    if (input_ids < 0).any() or (vocab_size is not None and (input_ids >= vocab_size).any()):
        raise EngineInputError(
            "batch.input_ids", f"token ids must lie in [0, {vocab_size}) (the model's vocabulary)"
        )
    tensors["input_ids"] = input_ids.long()
    shape = tuple(input_ids.shape)

    mask = _mask(batch, "attention_mask", shape, required=True)
    empty = ~mask.any(1)
    if empty.any():
        raise EngineInputError(
            "batch.attention_mask", f"row {int(empty.nonzero()[0, 0])} has no tokens"
        )
    tensors["attention_mask"] = mask
    if max_seq_len is not None:
        problem = longest_row_problem(tensors, max_seq_len, field="batch.input_ids")
        if problem is not None:
            raise EngineInputError(problem.field, problem.message)

    standard = (mask.long().cumsum(1) - 1).clamp(min=0)
    given = _integer(batch, "position_ids")
    if given is None:
        position_ids, is_standard = standard, True
    else:
        _check_shape("position_ids", given, shape)
        position_ids = given.long()
        is_standard = bool((position_ids[mask] == standard[mask]).all())
        tensors["position_ids"] = position_ids

    for name in ("prompts", "responses"):
        value = _integer(batch, name)
        if value is not None:
            if value.ndim != 2 or value.shape[0] != shape[0]:
                raise EngineInputError(
                    f"batch.{name}", f"expected [{shape[0]}, *], got {_shape(value)}"
                )
            tensors[name] = value.long()
    if "prompts" in tensors and "responses" in tensors:
        width = tensors["prompts"].shape[1] + tensors["responses"].shape[1]
        if width != shape[1]:
            raise EngineInputError(
                "batch.responses",
                f"prompts width + responses width = {width}, but input_ids has S = {shape[1]}",
            )

    for name in MASK_FIELDS:
        value = _mask(batch, name, shape)
        if value is not None:
            tensors[name] = value
    for name in FLOAT_FIELDS:
        value = _floating(batch, name, shape)
        if value is not None:
            tensors[name] = value

    labels = _integer(batch, "labels")
    if labels is not None:
        _check_shape("labels", labels, shape)
        labels = labels.long()
        used = labels != IGNORE_INDEX
        if (used & ~mask).any():
            raise EngineInputError(
                "batch.labels", "labels on padded positions (attention_mask=0); set them to -100"
            )
        if (labels[used] < 0).any() or (
            vocab_size is not None and (labels[used] >= vocab_size).any()
        ):
            raise EngineInputError(
                "batch.labels", f"labels must be -100 or lie in [0, {vocab_size})"
            )
        tensors["labels"] = labels

    return Batch(tensors=tensors, position_ids=position_ids, standard_positions=is_standard)


@dataclass(frozen=True)
class MicroBatch:
    """One model call: its inputs and the map from its outputs back to the batch's rows.

    ``rows`` are the batch rows it covers (outputs come back as ``[len(rows), S]``). Model inputs
    are ``[r, T]`` (``r = 1`` when packed). For each scored token ``n``: ``token_rows[n]`` (index
    into ``rows``), ``token_cols[n]`` (original column) and ``pred_index[n]`` (flat index into the
    model's ``[r * T]`` outputs of the position that predicts it). ``targets`` ``[r, T]`` holds,
    at each predicting position, the token it must score.
    """

    rows: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    token_rows: torch.Tensor
    token_cols: torch.Tensor
    pred_index: torch.Tensor

    @property
    def packed(self) -> bool:
        """Whether sequences were packed into the rows (they then carry no attention mask)."""
        return self.attention_mask is None

    @property
    def num_tokens(self) -> int:
        """Tokens the model processes (padding included)."""
        return int(self.input_ids.numel())

    def model_outputs(self, model: torch.nn.Module) -> torch.Tensor:
        """One model call; its ``logits`` output ``[r, T, V]`` (``[r, T, H]``, the head's input,
        while :meth:`~arctic_platform.engine.chunked_head.LMHead.bypassed`)."""
        return model(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            use_cache=False,
        ).logits

    def to(self, device: torch.device) -> MicroBatch:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=mask,
            targets=self.targets.to(device),
            token_rows=self.token_rows.to(device),
            token_cols=self.token_cols.to(device),
            pred_index=self.pred_index.to(device),
        )


def plan_microbatches(
    batch: Batch,
    targets: torch.Tensor,
    *,
    max_tokens: int,
    packing: bool,
    rows: list[int] | None = None,
) -> list[MicroBatch]:
    """Cut ``batch`` into microbatches of at most ``max_tokens`` model tokens (see module doc).

    ``targets`` ``[B, S]`` is the token to score at each position (``input_ids`` for RL; the labels
    for SFT). ``rows`` (ascending) restricts the plan to those rows; by default all.
    """
    rows = list(range(batch.size)) if rows is None else rows
    if not rows:
        return []
    all_lengths = batch.lengths.tolist()
    lengths = [all_lengths[i] for i in rows]
    if packing and batch.standard_positions and len(set(lengths)) > 1:
        packed_rows = _first_fit_decreasing(lengths, min(max_tokens, max(lengths)))
        packed_rows = [[rows[j] for j in row] for row in packed_rows]
        return [
            _packed(batch, targets, group, all_lengths)
            for group in _stack_rows(packed_rows, all_lengths, max_tokens)
        ]
    groups = _consecutive_groups(batch, rows, max_tokens)
    return [_padded(batch, targets, torch.tensor(g)) for g in groups]


# Most row-tail padding a stack of packed rows may carry (as a fraction of its tokens).
_MAX_ROW_PADDING = 0.1


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Packed rows: sequence indices whose lengths sum to at most ``capacity``, fullest first.

    A sequence longer than ``capacity`` gets a row of its own.
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    order = sorted(range(len(bins)), key=lambda b: (-loads[b], b))
    return [sorted(bins[b]) for b in order]


def _stack_rows(
    packed_rows: list[list[int]], lengths: list[int], budget: int
) -> list[list[list[int]]]:
    """Group consecutive packed rows (fullest first) into ``[k, W]`` microbatches (module doc)."""
    groups: list[list[list[int]]] = []
    width = used = 0
    for row in packed_rows:
        load = sum(lengths[i] for i in row)
        count = len(groups[-1]) + 1 if groups else 0
        padding = count * width - (used + load)
        if groups and count * width <= budget and padding <= _MAX_ROW_PADDING * count * width:
            groups[-1].append(row)
            used += load
        else:
            groups.append([row])
            width, used = load, load
    return groups


def _consecutive_groups(batch: Batch, rows: list[int], budget: int) -> list[list[int]]:
    """Consecutive ``rows`` while ``rows x trimmed span`` fits the budget (at least one each)."""
    mask = batch.attention_mask
    cols = torch.arange(batch.seq_len)
    starts = torch.where(mask, cols, batch.seq_len).min(1).values.tolist()
    ends = (torch.where(mask, cols, -1).max(1).values + 1).tolist()
    groups: list[list[int]] = []
    current: list[int] = []
    lo, hi = batch.seq_len, 0
    for i in rows:
        new_lo, new_hi = min(lo, starts[i]), max(hi, ends[i])
        if current and (len(current) + 1) * (new_hi - new_lo) > budget:
            groups.append(current)
            current, new_lo, new_hi = [], starts[i], ends[i]
        current.append(i)
        lo, hi = new_lo, new_hi
    groups.append(current)
    return groups


def _packed(
    batch: Batch, targets: torch.Tensor, packed_rows: list[list[int]], lengths: list[int]
) -> MicroBatch:
    """Sequences laid end to end in ``k`` rows as wide as the fullest; tails are dummy segments."""
    width = max(sum(lengths[i] for i in row) for row in packed_rows)
    k = len(packed_rows)
    input_ids = torch.zeros(k, width, dtype=torch.long)
    position_ids = torch.zeros(k, width, dtype=torch.long)
    rows: list[int] = []
    local_rows, cols, model_flat = [], [], []
    for r, row in enumerate(packed_rows):
        offset = 0
        for i in row:
            real = batch.attention_mask[i].nonzero().squeeze(1)
            span = slice(offset, offset + real.numel())
            input_ids[r, span] = batch.input_ids[i, real]
            position_ids[r, span] = batch.position_ids[i, real]
            local_rows.append(torch.full_like(real, len(rows)))
            cols.append(real)
            model_flat.append(torch.arange(span.start, span.stop) + r * width)
            rows.append(i)
            offset = span.stop
        position_ids[r, offset:] = torch.arange(width - offset)
    token_rows, token_cols, pred_index = _scored(
        torch.cat(local_rows), torch.cat(cols), torch.cat(model_flat)
    )
    row_index = torch.tensor(rows)
    model_targets = _model_targets(
        targets, row_index, token_rows, token_cols, pred_index, k * width
    )
    return MicroBatch(
        rows=row_index,
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=None,
        targets=model_targets.view(k, width),
        token_rows=token_rows,
        token_cols=token_cols,
        pred_index=pred_index,
    )


def _padded(batch: Batch, targets: torch.Tensor, rows: torch.Tensor) -> MicroBatch:
    full_mask = batch.attention_mask.index_select(0, rows)
    used = full_mask.any(0).nonzero().squeeze(1)
    lo, hi = int(used[0]), int(used[-1]) + 1
    mask = full_mask[:, lo:hi]
    width = hi - lo
    local_rows, local_cols = mask.nonzero(as_tuple=True)
    token_rows, token_cols, pred_index = _scored(
        local_rows, local_cols + lo, local_rows * width + local_cols
    )
    r = rows.numel()
    model_targets = _model_targets(targets, rows, token_rows, token_cols, pred_index, r * width)
    return MicroBatch(
        rows=rows,
        input_ids=batch.input_ids.index_select(0, rows)[:, lo:hi],
        position_ids=batch.position_ids.index_select(0, rows)[:, lo:hi],
        attention_mask=mask.long(),
        targets=model_targets.view(r, width),
        token_rows=token_rows,
        token_cols=token_cols,
        pred_index=pred_index,
    )


def _scored(
    local_rows: torch.Tensor, cols: torch.Tensor, model_flat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Real tokens in row-major order -> (row, column, predecessor's model index) of scored ones.

    A token is scored when the previous real token is in the same row; that previous token's model
    position is the one whose output predicts it.
    """
    same_row = torch.zeros_like(local_rows, dtype=torch.bool)
    same_row[1:] = local_rows[1:] == local_rows[:-1]
    idx = same_row.nonzero().squeeze(1)
    return local_rows[idx], cols[idx], model_flat[idx - 1]


def _model_targets(
    targets: torch.Tensor,
    rows: torch.Tensor,
    token_rows: torch.Tensor,
    token_cols: torch.Tensor,
    pred_index: torch.Tensor,
    size: int,
) -> torch.Tensor:
    flat = torch.zeros(size, dtype=torch.long)
    flat[pred_index] = targets.index_select(0, rows)[token_rows, token_cols]
    return flat


# -- field conversion -------------------------------------------------------------------------


def _tensor(batch: Mapping, name: str, *, required: bool = False) -> torch.Tensor | None:
    if name not in batch or batch[name] is None:
        if required:
            raise EngineInputError(f"batch.{name}", "missing")
        return None
    value = batch[name]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        if isinstance(value, np.ndarray):  # bf16 arrays (ml_dtypes) included
            if not (value.flags.writeable and value.flags.c_contiguous):
                value = np.array(value, order="C")
            return wire.to_torch(value)
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise EngineInputError(f"batch.{name}", f"not convertible to a tensor ({exc})") from exc


def _integer(batch: Mapping, name: str, *, required: bool = False) -> torch.Tensor | None:
    value = _tensor(batch, name, required=required)
    if value is not None and (
        value.is_floating_point() or value.dtype == torch.bool or value.is_complex()
    ):
        raise EngineInputError(f"batch.{name}", f"expected an integer tensor, got {value.dtype}")
    return value


def _mask(
    batch: Mapping, name: str, shape: tuple[int, ...], *, required: bool = False
) -> torch.Tensor | None:
    value = _tensor(batch, name, required=required)
    if value is None:
        return None
    _check_shape(name, value, shape)
    if value.is_complex() or not ((value == 0) | (value == 1)).all():
        raise EngineInputError(f"batch.{name}", "expected a 0/1 mask")
    return value.bool()


def _floating(batch: Mapping, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    value = _tensor(batch, name)
    if value is None:
        return None
    _check_shape(name, value, shape)
    if value.dtype == torch.bool or value.is_complex():
        raise EngineInputError(f"batch.{name}", f"expected a float tensor, got {value.dtype}")
    return value.float()


def _check_shape(name: str, value: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(value.shape) != shape:
        raise EngineInputError(
            f"batch.{name}", f"shape {_shape(value)} does not match input_ids {list(shape)}"
        )


def _shape(value: torch.Tensor) -> list[int]:
    return list(value.shape)
