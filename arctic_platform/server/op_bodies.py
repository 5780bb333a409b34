"""Validating op bodies at the server's edge, before anything runs.

JSON bodies are checked against their models (:mod:`arctic_platform.contract.bodies`), so a typo
is a 400 naming the key. Tensor-carrying bodies (forward-backward, forward) have their envelope
checked here and their tensors checked by the engine, which also names the field it rejects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from arctic_platform.contract.bodies import SNOWAPI_ENVELOPE_KEYS, TRAIN_ENVELOPE_KEYS
from arctic_platform.contract.problems import FieldError
from arctic_platform.contract.processing import parse_processing
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.limits import ServerLimits


def parse(model: type[BaseModel], body: Any, *, what: str) -> Any:
    """Validate ``body`` (None means empty) as ``model``; a 400 names the failing field."""
    if body is None:
        body = {}
    if not isinstance(body, Mapping):
        raise BadRequest(f"{what}: body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(dict(body))
    except ValidationError as exc:
        raise BadRequest(f"{what}: {describe(exc)}", field=field_of(exc)) from None


def field_of(exc: ValidationError) -> str | None:
    """The first failing field's path (``sampling_params.top_p``, ``prompts.0``), as the error's
    ``field`` detail: a contract rule's own field where one raised it, else pydantic's location;
    None for a problem with the body as a whole."""
    error = exc.errors()[0]
    ruled = error.get("ctx", {}).get("error")
    if isinstance(ruled, FieldError):
        return ruled.field
    return ".".join(str(p) for p in error["loc"]) or None


def describe(exc: ValidationError) -> str:
    """One line per problem, each naming its field path."""
    parts = []
    for error in exc.errors():
        location = ".".join(str(p) for p in error["loc"]) or "body"
        # The contract's rules name the field (and index) in their message already.
        ruled = error["type"] == "invalid_value" and (
            not error["loc"] or error["msg"].startswith(location)
        )
        parts.append(error["msg"] if ruled else f"{location}: {error['msg']}")
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


def train_envelope(
    body: Any, *, op: str, limits: ServerLimits | None = None
) -> tuple[Mapping, dict, dict, bool]:
    """``(batch, meta, processing, reference_model)`` of a forward-backward/forward body.

    Accepts the on-prem/verl form ``{batch, meta, processing, router_replay?}`` and the SnowAPI
    form ``{args: (), kwargs: {...tensors}, context?, meta?, processing?}``, whose ``context``
    (per-token loss inputs and scalars) is mapped into the batch and meta
    (:mod:`arctic_platform.server.cortex_context`). That mapping builds new per-token arrays, so
    the model inputs are held to ``limits`` (rows and tokens) before it. The processing names
    (post-processors, loss) are checked here, so an unknown one is refused when the request is
    submitted.
    """
    if not isinstance(body, Mapping):
        raise BadRequest(f"{op}: body must be an object, got {type(body).__name__}")
    keys = set(body)
    if "batch" in keys:
        unknown = keys - TRAIN_ENVELOPE_KEYS
        batch = body["batch"]
    elif "kwargs" in keys:
        unknown = keys - SNOWAPI_ENVELOPE_KEYS
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

        if limits is not None:
            limits.check_batch(op, batch)
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
    """An unknown post-processor or loss name is a 400 now, not a failed request later; the
    names are the contract's registries, so this imports no torch."""
    try:
        parse_processing(processing, default_loss=None)
    except FieldError as exc:
        raise BadRequest(f"{op}: {exc}", field=exc.field) from None
