"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay.

The factor multiplies the peak learning rate at optimizer update ``s`` (0-based), with ``W`` warmup
updates, ``T`` total updates and floor ``m = min_lr_ratio``:

* warmup, ``s < W``: ``s / W`` (the HF/verl convention, so the first warmup update has lr 0)
* ``constant``: 1
* ``linear``: ``m + (1 - m) * max(0, (T - s) / (T - W))``
* ``cosine``: ``m + (1 - m) * (1 + cos(pi * p)) / 2`` with ``p = min(1, (s - W) / (T - W))``

Wrapped in torch's ``LambdaLR`` so the optimizer's learning rate, checkpoints and resumption follow
torch's own scheduler state.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from arctic_platform.engine.config import SchedulerConfig


def lr_factor(config: SchedulerConfig, step: int) -> float:
    """Multiplier of the peak learning rate at update ``step`` (see module doc)."""
    warmup = config.warmup_steps
    if step < warmup:
        return step / warmup
    if config.name == "constant":
        return 1.0
    total = config.total_steps
    floor = config.min_lr_ratio
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if config.name == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig) -> LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_factor`; decaying schedules need ``total_steps``."""
    return LambdaLR(optimizer, lambda step: lr_factor(config, step))
