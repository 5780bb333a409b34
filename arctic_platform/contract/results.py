"""The results of the compute ops, defined once: what fwd_bwd, fwd_no_grad and step answer.

Frameworks read more than one name for the same number (verl reads ``avg_loss``, SkyRL ``loss``;
``grad_norm`` and ``last_lr`` both at the top level and in ``metrics``), so the shapes are built
here and nowhere else: the engines' answers, the server's op results and the client's shaping of
any server's answer (ours, or a reference server that omits an alias) all call these functions.
Generate results are in :mod:`arctic_platform.contract.generate_columns`.

* ``fwd_bwd``: ``{job_id, avg_loss, loss, metrics}``
* ``fwd_no_grad``: ``{job_id, batch: {logprobs[, entropy]}, model_outputs, metrics, avg_loss,
  loss}``
* ``step``: ``{job_id, global_steps, last_lr, grad_norm, metrics: {grad_norm, last_lr, ...}}``
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The per-token outputs ``fwd_no_grad`` returns, in this order.
FORWARD_OUTPUTS = ("logprobs", "entropy")
# Step values reported both at the top level and in ``metrics``.
STEP_VALUES = ("grad_norm", "last_lr")


def loss_fields(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{avg_loss, loss}``: the batch's loss (its ``loss`` metric; 0 when there is none)."""
    loss = float(metrics.get("loss", 0.0))
    return {"avg_loss": loss, "loss": loss}


def fwd_bwd_result(job_id: str, out: Mapping[str, Any]) -> dict[str, Any]:
    """The ``forward-backward`` result from an engine's answer (``metrics``)."""
    return {"job_id": job_id, **loss_fields(out["metrics"]), "metrics": dict(out["metrics"])}


def forward_result(job_id: str, out: Mapping[str, Any]) -> dict[str, Any]:
    """The ``forward`` (fwd_no_grad) result from an engine's answer: its per-token outputs,
    metrics and, when a loss was computed, the loss."""
    metrics = dict(out.get("metrics") or {})
    return {
        "job_id": job_id,
        "batch": {k: out[k] for k in FORWARD_OUTPUTS if k in out},
        "metrics": metrics,
        **loss_fields(metrics),
    }


def step_result(job_id: str, out: Mapping[str, Any]) -> dict[str, Any]:
    """The ``step`` result from an engine's answer."""
    return {
        "job_id": job_id,
        "global_steps": out["global_steps"],
        "last_lr": out["last_lr"],
        "grad_norm": out["grad_norm"],
        "metrics": dict(out["metrics"]),
    }


def shape_train_result(result: Mapping) -> dict:
    """Any server's fwd_bwd / fwd_no_grad answer with every alias frameworks read: ``loss`` and
    ``avg_loss`` (from each other, or from ``metrics.loss``), ``batch`` and ``model_outputs``."""
    out = dict(result)
    metrics = out.get("metrics")
    out["metrics"] = dict(metrics) if isinstance(metrics, Mapping) else {}
    if "avg_loss" not in out and "loss" not in out and "loss" in out["metrics"]:
        out.update(loss_fields(out["metrics"]))
    if "avg_loss" in out:
        out.setdefault("loss", out["avg_loss"])
    elif "loss" in out:
        out["avg_loss"] = out["loss"]
    if "batch" not in out and "model_outputs" in out:
        out["batch"] = out["model_outputs"]
    if "batch" in out:
        out.setdefault("model_outputs", out["batch"])
    return out


def shape_step_result(result: Mapping) -> dict:
    """Any server's step answer with ``grad_norm`` and ``last_lr`` both at the top level and in
    ``metrics``."""
    out = dict(result)
    metrics = dict(out.get("metrics") or {})
    for key in STEP_VALUES:
        if key in out:
            metrics.setdefault(key, out[key])
        elif key in metrics:
            out[key] = metrics[key]
    out["metrics"] = metrics
    return out
