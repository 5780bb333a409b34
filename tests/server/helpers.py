"""Helpers shared by the server tests: a GRPO step's data built the way an RL loop builds it,
weight comparisons, and the peak memory a request costs the server running in the test process."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from arctic_platform.advantages import grpo_advantages
from arctic_platform.layout import training_batch

T = TypeVar("T")
PROMPTS = ["1+2=", "3+4="]
SAMPLING = {"n": 4, "max_tokens": 6, "temperature": 1.0, "seed": 7}


def reward(text: str) -> float:
    """A programmatic reward: how many digits the completion has."""
    return float(sum(ch.isdigit() for ch in text))


def grpo_batch(prompt_ids: list[list[int]], results: list[dict], n: int) -> dict:
    """The verl-layout batch for generation ``results`` (``n`` samples per prompt)."""
    rewards = [reward(r["text"]) for r in results]
    advantages = grpo_advantages(np.array(rewards), group_size=n)
    prompts = [prompt_ids[i // n] for i in range(len(results))]
    responses = [list(r["token_ids"]) for r in results]
    batch = training_batch(prompts, responses, pad_token_id=0, advantages=advantages)
    return {k: torch.as_tensor(v) for k, v in batch.items()}


def weights_of(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{key}:\s+(\d+)", status.read()).group(1)) / 1024


def traced_peak_mib(send: Callable[[], T]) -> tuple[T, float]:
    """``send()``'s answer and the peak of Python and numpy allocations it made, in MiB
    (``tracemalloc``, all threads: the in-process server's and the client's). Unlike the peak
    RSS it does not move with the C allocator's state (how many copies a ``realloc`` made, what
    earlier tests left in the heap), so a bound on it can be tight; torch's own allocations are
    not traced, so it suits requests refused before any tensor is made."""
    import tracemalloc

    tracemalloc.start()
    try:
        answer = send()
        return answer, tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def peak_growth_mib(send: Callable[[], T]) -> tuple[T, float]:
    """``send()``'s answer and how far this process's peak RSS rose above its RSS before, in
    MiB: what a request costs a server running in this process (``serve_app``, ASGI)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # restart the peak (VmHWM) from the current RSS
    before = _status_mib("VmRSS")
    answer = send()
    return answer, _status_mib("VmHWM") - before
