"""Metric reduction: per-microbatch sums into global token means.

Losses report ``name.sum`` / ``name.tokens`` pairs and plain numbers. Pairs are summed over
microbatches and finalised as ``sum / tokens``, so a metric is the mean over every loss token of
the batch however the batch was split. Plain numbers (``kl_coef``) are averaged.

The raw sums are what a data-parallel layer all-reduces: each worker returns
:meth:`MetricSums.raw`, and :func:`reduce_metrics` over the workers' raw dicts gives the global
means (the same rule the reference server applies across shards).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

_PAIR_SUFFIXES = (".sum", ".tokens")


class MetricSums:
    """Accumulates microbatch metrics; tensors stay on their device until :meth:`raw`."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor | float] = {}
        self._plain: dict[str, list[float]] = {}

    def add(self, metrics: Mapping[str, torch.Tensor | float]) -> None:
        for name, value in metrics.items():
            if name.endswith(_PAIR_SUFFIXES):
                value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
                self._sums[name] = self._sums.get(name, 0.0) + value
            else:
                self._plain.setdefault(name, []).append(float(value))

    def raw(self) -> dict[str, float]:
        """The summed pairs and the averaged plain values, as Python floats."""
        out = {name: float(value) for name, value in self._sums.items()}
        out.update({name: sum(vals) / len(vals) for name, vals in self._plain.items()})
        return out

    def finalize(self) -> dict[str, float]:
        return finalize_metrics(self.raw())


def finalize_metrics(raw: Mapping[str, float]) -> dict[str, float]:
    """``name.sum`` / ``name.tokens`` -> ``name`` (0 without tokens); plain values pass through."""
    out: dict[str, float] = {}
    for name, value in raw.items():
        if name.endswith(".sum"):
            base = name[: -len(".sum")]
            tokens = raw.get(base + ".tokens", 0.0)
            out[base] = float(value) / tokens if tokens else 0.0
        elif not name.endswith(".tokens"):
            out[name] = float(value)
    return out


def reduce_metrics(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine raw metrics from several workers (or calls) into global token means."""
    total = MetricSums()
    for part in parts:
        total.add(part)
    return total.finalize()
