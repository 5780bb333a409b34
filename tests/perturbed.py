"""Built-in models with varied greedy continuations, for tests that compare engines' outputs.

A built-in model's random initialisation gives nearly uniform, repetitive predictions; adding
seeded noise to its matrices makes greedy continuations vary, and some end at an
end-of-sequence token."""

from __future__ import annotations

import torch

NOISE = 0.15  # standard deviation added to every matrix


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` in eval mode with seeded noise added to its matrices in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.add_(torch.randn(param.shape, generator=gen) * NOISE)
    return model.eval()
