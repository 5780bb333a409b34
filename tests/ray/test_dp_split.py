"""Splitting a batch's rows across data-parallel workers by token count, and merging back."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from arctic_platform.server.dp_split import merge_rows, split_by_tokens, take_rows


def test_longest_rows_spread_and_short_ones_fill_up():
    parts = split_by_tokens([9, 1, 1, 1, 1, 1, 1, 1, 1], 2)
    assert [p.tolist() for p in parts] == [[0], [1, 2, 3, 4, 5, 6, 7, 8]]


def test_balance_is_by_tokens_not_rows():
    tokens = [2, 8, 3, 7, 5, 5]
    parts = split_by_tokens(tokens, 2)
    loads = [sum(tokens[r] for r in p) for p in parts]
    assert loads == [15, 15]
    assert [p.tolist() for p in parts] == [[0, 1, 5], [2, 3, 4]]


def test_fewer_rows_than_workers_leaves_the_last_workers_idle():
    assert [p.tolist() for p in split_by_tokens([4, 6], 4)] == [[1], [0], [], []]


def test_rows_sharing_a_prompt_stay_together_and_count_the_prompt_once():
    # Rows 0, 2, 4 share a prompt: 42 tokens as rows, 22 once the prompt counts once (saved 20).
    tokens = [14, 16, 14, 17, 14, 5]
    parts = split_by_tokens(tokens, 2, groups=[[0, 2, 4]], saved=[20])
    assert [p.tolist() for p in parts] == [[0, 2, 4, 5], [1, 3]]  # loads 27 and 33
    # Counted row by row, the group would look heavier than both single rows together.
    parts = split_by_tokens(tokens, 2, groups=[[0, 2, 4]])
    assert [p.tolist() for p in parts] == [[0, 2, 4], [1, 3, 5]]


def test_one_worker_keeps_the_batch_as_sent():
    assert split_by_tokens([3, 9, 1], 1)[0].tolist() == [0, 1, 2]


def test_worker_count_must_be_positive():
    with pytest.raises(ValueError, match="workers"):
        split_by_tokens([1], 0)


@given(
    tokens=st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=40),
    workers=st.integers(min_value=1, max_value=6),
)
def test_split_is_a_balanced_partition(tokens, workers):
    parts = split_by_tokens(tokens, workers)
    assert len(parts) == workers
    flat = np.concatenate(parts)
    assert sorted(flat.tolist()) == list(range(len(tokens)))  # every row exactly once
    for part in parts:
        assert part.tolist() == sorted(part.tolist())  # original order within a worker
    if len(tokens) >= workers:
        assert all(len(p) for p in parts)
        loads = [sum(tokens[r] for r in p) for p in parts]
        # Greedy longest-first: no worker is more than one sequence above the lightest one.
        assert max(loads) - min(loads) <= max(tokens)


def test_take_and_merge_put_rows_back_in_order():
    batch = {
        "input_ids": np.arange(12).reshape(6, 2),
        "advantages": np.linspace(0, 1, 6, dtype=np.float32)[:, None].repeat(2, 1),
        "note": "replicated",
        "other": np.arange(3),  # not [B, ...]: replicated, not split
    }
    parts = split_by_tokens([1, 5, 2, 4, 3, 6], 3)
    shards = [take_rows(batch, rows, 6) for rows in parts]
    for rows, shard in zip(parts, shards, strict=True):
        np.testing.assert_array_equal(shard["input_ids"], batch["input_ids"][rows])
        assert shard["note"] == "replicated"
        np.testing.assert_array_equal(shard["other"], np.arange(3))
    pieces = [(rows, shard["input_ids"]) for rows, shard in zip(parts, shards, strict=True)]
    merged = merge_rows(pieces, 6)
    np.testing.assert_array_equal(merged, batch["input_ids"])
    idle = merge_rows([(np.array([0, 1]), np.ones((2, 2))), (np.array([], int), None)], 2)
    np.testing.assert_array_equal(idle, np.ones((2, 2)))
