"""Split a batch's rows across data-parallel workers by token count, and put results back in order.

A worker's time grows with the tokens it processes, not its row count, so rows are assigned
greedily, longest first, to the worker with the fewest tokens so far (ties: fewer rows, then lower
rank). That keeps every worker within one sequence of the mean load and, when there are at least
as many rows as workers, gives every worker at least one row. With fewer rows than workers the
last workers get none; the data-parallel trainer runs them with zero-weight calls (see
:mod:`arctic_platform.engine.data_parallel`), so any batch size works. Rows that share a prompt
travel as one unit, so their worker computes the prompt once
(:mod:`arctic_platform.engine.prompt_sharing`); the unit's load counts the prompt once.

Within a worker, rows keep their original relative order, so a one-worker job sees the batch
exactly as sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def split_by_tokens(
    token_counts: Sequence[int] | np.ndarray,
    workers: int,
    *,
    groups: Sequence[Sequence[int]] = (),
    saved: Sequence[int] = (),
) -> list[np.ndarray]:
    """The row indices (ascending) each of ``workers`` workers gets (see module doc).

    Rows listed together in ``groups`` (rows sharing a prompt) go to one worker as a unit whose
    load is its rows' tokens less ``saved[k]`` (the prompt tokens it computes once); every other
    row is a unit of its own.
    """
    if workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers}")
    counts = np.asarray(token_counts, dtype=np.int64).reshape(-1)
    grouped = {int(row) for group in groups for row in group}
    units = [[int(row) for row in group] for group in groups]
    units += [[row] for row in range(len(counts)) if row not in grouped]
    loads_of = [int(counts[unit].sum()) for unit in units]
    for k, tokens in enumerate(saved):
        loads_of[k] -= int(tokens)
    order = sorted(range(len(units)), key=lambda u: (-loads_of[u], min(units[u])))
    loads = [0] * workers
    assigned: list[list[int]] = [[] for _ in range(workers)]
    for unit in order:
        worker = min(range(workers), key=lambda w: (loads[w], len(assigned[w]), w))
        assigned[worker].extend(units[unit])
        loads[worker] += loads_of[unit]
    return [np.array(sorted(rows), dtype=np.int64) for rows in assigned]


def take_rows(batch: Mapping[str, Any], rows: np.ndarray, size: int) -> dict[str, Any]:
    """The rows ``rows`` of every ``[size, ...]`` array in ``batch``; other values as they are."""
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == size:
            out[name] = value[rows]
        else:
            out[name] = value
    return out


def merge_rows(parts: Sequence[tuple[np.ndarray, np.ndarray]], size: int) -> np.ndarray:
    """One ``[size, ...]`` array from ``(row indices, rows)`` pieces, rows back in place."""
    first = next(values for rows, values in parts if len(rows))
    out = np.zeros((size, *first.shape[1:]), dtype=first.dtype)
    for rows, values in parts:
        if len(rows):
            out[rows] = values
    return out
