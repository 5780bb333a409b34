"""KL estimators between the policy and a reference policy, per token (verl's ``kl_penalty``).

With ``d = logp - logp_ref``:

* ``k1`` / ``kl``: ``d``
* ``abs``: ``|d|``
* ``k2`` / ``mse``: ``d^2 / 2``
* ``k3`` / ``low_var_kl``: ``x = clamp(-d, -20, 20); clamp(exp(x) - x - 1, -10, 10)``

A ``+`` suffix (``k3+``, ``k1+``, ...) is the straight-through variant: the value of the base
estimator with the gradient of ``k2`` (``k2 - sg(k2) + sg(base)``), an unbiased-gradient KL with a
low-variance value. verl's server copy forgets to strip the suffix and fails; we support it.
"""

from __future__ import annotations

import torch

from arctic_platform.engine.errors import EngineInputError

_BASE = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
}
KL_TYPES = tuple(_BASE) + tuple(f"{name}+" for name in _BASE)


def check_kl_type(field: str, kind) -> str:
    if kind not in KL_TYPES:
        raise EngineInputError(field, f"unknown kl type {kind!r}; known: {', '.join(KL_TYPES)}")
    return kind


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of type ``kind`` (see module doc)."""
    straight_through = kind.endswith("+")
    value = _estimate(logprob, ref_logprob, _BASE[kind.rstrip("+")])
    if not straight_through:
        return value
    k2 = _estimate(logprob, ref_logprob, "k2")
    return k2 - k2.detach() + value.detach()


def _estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, base: str) -> torch.Tensor:
    diff = logprob - ref_logprob
    if base == "k1":
        return diff
    if base == "abs":
        return diff.abs()
    if base == "k2":
        return 0.5 * diff.square()
    x = torch.clamp(-diff, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)
