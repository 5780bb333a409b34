"""The body of every op, validated at the edge before anything runs.

JSON bodies are pydantic models that forbid unknown keys, so a typo is a 400 naming the key.
Tensor-carrying bodies (forward-backward, forward) have their envelope checked here and their
tensors checked by the engine, which also names the field it rejects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from arctic_platform.server.errors import BadRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepBody(_Body):
    learning_rate: float | None = Field(None, gt=0.0)


class SaveBody(_Body):
    checkpoint_id: str | None = None
    checkpoint_type: Literal["resumable", "weights-only"] = "resumable"
    path: str | None = None
    step: NonNegativeInt | None = None
    export_hf: bool = False
    save_total_limit: NonNegativeInt | None = None
    stage_info: dict[str, Any] | None = None


class LoadBody(_Body):
    """On-prem form ``{path, step}`` or Cortex form ``{checkpoint_id, source_job_id?}``."""

    path: str | None = None
    step: NonNegativeInt | None = None
    checkpoint_id: str | None = None
    source_job_id: str | None = None
    target_sub_job_id: str | None = None


class GenerateBody(_Body):
    prompts: list[str | list[int]] = Field(min_length=1)
    sampling_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    routing_key: Any = None
    strict: bool = False


class LogProbsBody(_Body):
    prompts: list[str | list[int]] = Field(min_length=1)
    completions: list[str | list[int]] | None = None
    top_k: NonNegativeInt = 1


class WeightSyncBody(_Body):
    source_sub_job_id: str | int | None = None
    target_sub_job_ids: list[str | int] = Field(min_length=1)
    cuda_ipc: bool | None = None
    low_memory: bool | None = None
    weight_format: Literal["vllm", "hf", "lora"] | None = None


class ResetPrefixCacheBody(_Body):
    drain: bool = True
    timeout_s: float = Field(60.0, gt=0.0)
    retry_interval_s: float = Field(0.1, gt=0.0)


class SleepInferenceBody(_Body):
    level: int = Field(1, ge=1, le=2)


class SleepTrainingBody(_Body):
    mode: Literal["all", "non_lp", "lp_params"] = "all"


class EmptyBody(_Body):
    pass


class CancelRequestBody(_Body):
    request_id: str = Field(min_length=1)


class TailLogsBody(_Body):
    cursor: str | int | None = None
    max_lines: int = Field(200, ge=1, le=10_000)


class OperationBody(_Body):
    operation_type: str = Field(min_length=1)
    sub_job_id: str | int | None = None
    sub_job_type: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)


def parse(model: type[_Body], body: Any, *, what: str) -> Any:
    """Validate ``body`` (None means empty) as ``model``; a 400 names the failing field."""
    if body is None:
        body = {}
    if not isinstance(body, Mapping):
        raise BadRequest(f"{what}: body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(dict(body))
    except ValidationError as exc:
        raise BadRequest(f"{what}: {describe(exc)}") from None


def describe(exc: ValidationError) -> str:
    """One line per problem, each naming its field path."""
    parts = []
    for error in exc.errors():
        location = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{location}: {error['msg']}")
    return "; ".join(parts)


def wake_tags(body: Any) -> list[str] | None:
    """``wake-inference`` takes a tag list, ``{"tags": [...]}``, or nothing."""
    if body is None:
        return None
    if isinstance(body, Mapping):
        if set(body) - {"tags"}:
            raise BadRequest(f"wake-inference: unknown keys {sorted(set(body) - {'tags'})}")
        body = body.get("tags")
        if body is None:
            return None
    if not isinstance(body, list) or not all(isinstance(t, str) for t in body):
        raise BadRequest("wake-inference: tags must be a list of strings")
    return body


TRAIN_ENVELOPE_KEYS = {"batch", "meta", "processing", "router_replay", "reference_model"}
CORTEX_ENVELOPE_KEYS = {"args", "kwargs", "context", "meta", "processing", "reference_model"}


def train_envelope(body: Any, *, op: str) -> tuple[Mapping, dict, dict, bool]:
    """``(batch, meta, processing, reference_model)`` of a forward-backward/forward body.

    Accepts the on-prem/verl form ``{batch, meta, processing, router_replay?}`` and the SnowAPI
    form ``{args: (), kwargs: {...tensors}, context?, meta?, processing?}``, whose ``context``
    (per-token loss inputs and scalars) is mapped into the batch and meta
    (:mod:`arctic_platform.server.cortex_context`). The processing names (post-processors, loss)
    are checked here, so an unknown one is refused when the request is submitted.
    """
    if not isinstance(body, Mapping):
        raise BadRequest(f"{op}: body must be an object, got {type(body).__name__}")
    keys = set(body)
    if "batch" in keys:
        unknown = keys - TRAIN_ENVELOPE_KEYS
        batch = body["batch"]
    elif "kwargs" in keys:
        unknown = keys - CORTEX_ENVELOPE_KEYS
        if body.get("args") not in (None, (), []):
            raise BadRequest(f"{op}: args: positional tensors are not supported; use kwargs")
        batch = body["kwargs"]
    else:
        raise BadRequest(f"{op}: body needs 'batch' (or SnowAPI 'kwargs') holding the tensors")
    if unknown:
        raise BadRequest(f"{op}: unknown keys {sorted(unknown)}")
    if body.get("router_replay") is not None:
        raise BadRequest(f"{op}: router_replay: MoE router replay is not supported by this server")
    if not isinstance(batch, Mapping) or not batch:
        raise BadRequest(f"{op}: batch must be a non-empty mapping of tensors")
    meta = body.get("meta") or {}
    context = body.get("context") or {}
    processing = body.get("processing") or {}
    for name, value in (("meta", meta), ("context", context), ("processing", processing)):
        if not isinstance(value, Mapping):
            raise BadRequest(f"{op}: {name} must be an object")
    if context:
        from arctic_platform.server.cortex_context import context_into_batch

        batch, scalars = context_into_batch(batch, context, op=op)
        clash = sorted(k for k in scalars if k in meta and meta[k] != scalars[k])
        if clash:
            raise BadRequest(f"{op}: {clash[0]} differs between meta and context")
        meta = {**meta, **scalars}
    reference = body.get("reference_model", False)
    if not isinstance(reference, bool):
        raise BadRequest(f"{op}: reference_model must be a boolean")
    _check_processing_names(processing, op=op)
    return batch, dict(meta), dict(processing), reference


def _check_processing_names(processing: Mapping, *, op: str) -> None:
    """An unknown post-processor or loss name is a 400 now, not a failed request later."""
    from arctic_platform.engine.errors import EngineInputError
    from arctic_platform.engine.losses import get_loss
    from arctic_platform.engine.meta import parse_processing

    try:
        parsed = parse_processing(processing, default_loss=None)
        if parsed.loss_fn is not None:
            get_loss(parsed.loss_fn)
    except EngineInputError as exc:
        raise BadRequest(f"{op}: {exc}", field=exc.field) from None
