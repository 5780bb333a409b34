"""The Tinker HTTP API (``/api/v1/...``) that the ``tinker`` SDK and tinker-cookbook call.

Auth: the SDK sends its API key as ``X-API-Key`` and refuses keys without the ``tml-`` prefix, so
tenants give it their server token in that form (``serve --token-env`` tokens such as
``tml-team-a``); the owner id is the same as for ``Authorization: Bearer`` with that token.

Every op answers ``{"request_id"}`` (the ``UntypedAPIFuture`` shape) and is polled with
``retrieve_future`` (:mod:`.futures`). Hosted-only features answer as the SDK expects: the client
config turns off JWT exchange and server-side custom losses, the catalogue lists the built-in
models, telemetry is accepted and dropped.
"""

from __future__ import annotations

import functools
import time
from datetime import datetime, timezone
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel, ValidationError

from arctic_platform.engine.builtin import BUILTIN_MODELS, BUILTIN_PREFIX, BuiltinSpec
from arctic_platform.server.auth import API_KEY_HEADER
from arctic_platform.server.errors import BadRequest, NotFound, Unauthorized
from arctic_platform.server.http_common import (
    caller_of,
    decode_json,
    long_poll,
    off_loop,
    read_body,
)
from arctic_platform.server.op_bodies import describe, field_of
from arctic_platform.server.tinker import bodies, codec, proto
from arctic_platform.server.tinker.checkpoints import TinkerPath
from arctic_platform.server.tinker.operations import TinkerOps

LINK_LIFETIME_S = 3600  # how long a get_external_weights_urls link opens its file
# Training runs a listing answers when the caller names no ``limit`` (the SDK's default).
RUNS_PAGE = 20

API_KEY_PREFIX = "tml-"

router = APIRouter(prefix="/api/v1")
Body = TypeVar("Body", bound=BaseModel)


def _ops(request: Request) -> TinkerOps:
    return request.app.state.tinker


def _owner(request: Request) -> str | None:
    """The caller's owner id from ``X-API-Key`` (see module doc); None when auth is off."""
    auth = request.app.state.auth
    if not auth.enabled:
        return None
    if not request.headers.get(API_KEY_HEADER):
        raise Unauthorized(f"missing API key (X-API-Key: {API_KEY_PREFIX}...)")
    return caller_of(request)


async def _parse(
    request: Request,
    model: type[Body],
    what: str,
    *,
    sequenced: bool = False,
    owner: str | None = None,
) -> Body:
    """The body as ``model``, parsed and validated off the event loop when large. A training
    client's op (``sequenced``, with its caller's ``owner``) refused here still uses up its
    ``seq_id`` (:meth:`TinkerOps.refused`), so the client's later requests run."""
    body = await read_body(request)
    limits = request.app.state.service.limits
    refused = functools.partial(_ops(request).refused, owner=owner) if sequenced else None
    return await off_loop(len(body), _validated, body, model, what, limits, refused)


def _validated(body: bytes, model: type[Body], what: str, limits, refused) -> Body:
    raw = decode_json(body, what=what, limits=limits)
    try:
        return model.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        if refused is not None:
            refused(raw)
        raise BadRequest(f"{what}: {describe(exc)}", field=field_of(exc)) from None


def _future(request_id: str, **extra: Any) -> dict:
    return {"request_id": request_id, **extra}


# -- handshake ------------------------------------------------------------------------------


@router.post("/client/config")
async def client_config(request: Request) -> dict:
    """What the SDK should do. Each sample request is polled on its own (no sampling session),
    so a sampling client keeps at most half of the tenant's long polls waiting
    (``--max-long-polls-per-tenant``), the rest left to training futures and other clients.
    A forward_backward's chunks are sent in order: sent in parallel, the first one last, the
    later ones would wait parked for it, and once they filled the tenant's
    ``--max-pending-mb-per-tenant`` the SDK would retry them for ever, never sending the first
    (here each chunk runs as its own op anyway; nothing is gained by parking them)."""
    _owner(request)
    long_polls = request.app.state.service.limits.max_long_polls_per_tenant
    return {
        "pjwt_auth_enabled": False,
        "custom_loss_server_side": False,
        "sample_use_retrieve_futures": False,
        "sample_join_sampling_session": False,
        "sample_max_concurrent_requests": max(1, long_polls // 2),
        "parallel_fwdbwd_chunks": False,
        "use_pyqwest_transport": False,
    }


@router.post("/client/dynamic_config")
async def client_dynamic_config(request: Request) -> dict:
    _owner(request)
    return {"sample_cancel_enabled": False}


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict:
    _owner(request)
    return {"supported_models": [_catalogue_entry(n, s) for n, s in BUILTIN_MODELS.items()]}


def _catalogue_entry(name: str, spec: BuiltinSpec) -> dict:
    return {
        "model_name": BUILTIN_PREFIX + name,
        "max_context_length": spec.max_position_embeddings,
        "trainable": True,
        "sampleable": True,
    }


@router.post("/telemetry")
async def telemetry(request: Request) -> dict:
    _owner(request)
    await read_body(request)
    return {"status": "accepted"}


# -- sessions -------------------------------------------------------------------------------


@router.post("/create_session")
async def create_session(request: Request) -> dict:
    owner = _owner(request)
    await read_body(request)
    ops = _ops(request)
    session = ops.state.new_session(owner, ops.service.limits)
    return {"type": "create_session", "session_id": session.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> dict:
    owner = _owner(request)
    body = await _parse(request, bodies.SessionBody, "session_heartbeat")
    session = _ops(request).state.session(body.session_id, owner)
    session.last_heartbeat = time.time()
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> Response:
    owner = _owner(request)
    await _parse(request, bodies.FinishBody, "finish")
    await run_in_threadpool(_ops(request).finish_session, session_id, owner)
    return Response(status_code=204)


# -- training -------------------------------------------------------------------------------


@router.post("/create_model")
async def create_model(request: Request) -> dict:
    owner = _owner(request)
    body = await _parse(request, bodies.CreateModelBody, "create_model")
    request_id = await run_in_threadpool(_ops(request).create_model, body, owner)
    return _future(request_id)


@router.post("/get_info")
async def get_info(request: Request) -> dict:
    owner = _owner(request)
    body = await _parse(request, bodies.ModelBody, "get_info")
    return _ops(request).get_info(body.model_id, owner)


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict:
    owner = _owner(request)
    if proto.CONTENT_TYPE not in request.headers.get("content-type", ""):
        raise BadRequest(f"forward_backward: expected a protobuf body ({proto.CONTENT_TYPE})")
    if request.headers.get("content-encoding", "identity") != "identity":
        raise BadRequest("forward_backward: compressed bodies are not accepted")
    body = await read_body(request)
    parsed = await off_loop(
        len(body),
        codec.decode_forward_backward,
        body,
        max_data_bytes=request.app.state.max_body_bytes,
    )
    request_id = await run_in_threadpool(_ops(request).forward_backward, parsed, owner)
    return _future(request_id, model_id=parsed.model_id)


# Training-client ops with a JSON body that answer their future and model id: the route, its body
# model and the TinkerOps method that queues it.
_MODEL_OPS = (
    ("optim_step", bodies.OptimStepBody, TinkerOps.optim_step),
    ("save_weights", bodies.SaveWeightsBody, TinkerOps.save_state),
    ("save_weights_for_sampler", bodies.SaveForSamplerBody, TinkerOps.save_for_sampler),
    ("save_weights_external", bodies.SaveWeightsBody, TinkerOps.save_external),
)


def _model_op_route(name: str, model: type[BaseModel], method):
    async def route(request: Request) -> dict:
        owner = _owner(request)
        body = await _parse(request, model, name, sequenced=True, owner=owner)
        return _future(method(_ops(request), body, owner), model_id=body.model_id)

    route.__name__ = name
    return route


for _name, _model, _method in _MODEL_OPS:
    router.add_api_route(f"/{_name}", _model_op_route(_name, _model, _method), methods=["POST"])


@router.post("/load_weights")
async def load_weights(request: Request) -> dict:
    owner = _owner(request)
    body = await _parse(
        request, bodies.LoadWeightsBody, "load_weights", sequenced=True, owner=owner
    )
    return _future(await run_in_threadpool(_ops(request).load_weights, body, owner))


# -- sampling -------------------------------------------------------------------------------


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict:
    owner = _owner(request)
    body = await _parse(request, bodies.CreateSamplingSessionBody, "create_sampling_session")
    sampler_id = await run_in_threadpool(_ops(request).create_sampling_session, body, owner)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> dict:
    sampler = _ops(request).state.sampler(sampler_id, _owner(request))
    return {
        "sampler_id": sampler.sampler_id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


@router.post("/asample")
async def asample(request: Request) -> dict:
    owner = _owner(request)
    body = await _parse(request, bodies.SampleBody, "asample")
    # In a worker thread: a sample on a model may start a sampling job and release another
    # (model_samplers.py), which must not hold up the event loop's other requests.
    request_id, sequence_ids = await run_in_threadpool(_ops(request).sample, body, owner)
    return _future(request_id, sample_sequence_ids=sequence_ids)


# -- futures --------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    owner = _owner(request)
    body = await _parse(request, bodies.RetrieveBody, "retrieve_future")
    return await _ops(request).futures.retrieve(
        body.request_id, owner, waiting=functools.partial(long_poll, request)
    )


# -- checkpoints and runs (RestClient) ------------------------------------------------------


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, request: Request) -> dict:
    owner = _owner(request)
    return {"checkpoints": _ops(request).checkpoints.list(model_id, owner)}


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(model_id: str, kind: str, name: str, request: Request) -> Response:
    path = TinkerPath.parse(f"tinker://{model_id}/{kind}/{name}", field="checkpoint")
    _ops(request).checkpoints.delete(path, _owner(request))
    return Response(status_code=204)


@router.get("/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(model_id: str, kind: str, name: str, request: Request) -> dict:
    ops, owner = _ops(request), _owner(request)
    path = TinkerPath.parse(f"tinker://{model_id}/{kind}/{name}", field="checkpoint")
    expires = time.time() + LINK_LIFETIME_S
    urls = {}
    for relative in ops.checkpoints.exported_files(path, owner):
        token = ops.service.links.sign([owner, str(path), relative], expires=expires)
        urls[relative] = str(request.url_for("download", token=token))
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, tz=timezone.utc).isoformat()}


@router.put("/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
async def set_checkpoint_ttl(model_id: str, kind: str, name: str, request: Request) -> Response:
    owner = _owner(request)
    body = await _parse(request, bodies.TtlBody, "ttl")
    path = TinkerPath.parse(f"tinker://{model_id}/{kind}/{name}", field="checkpoint")
    _ops(request).checkpoints.set_ttl(path, owner, body.ttl_seconds)
    return Response(status_code=204)


@router.get("/downloads/{token}", name="download")
async def download(token: str, request: Request) -> FileResponse:
    """A checkpoint file behind a signed link (no credentials: the link is the capability)."""
    ops = _ops(request)
    owner, tinker_path, relative = ops.service.links.verify(token)
    files = ops.checkpoints.exported_files(TinkerPath.parse(tinker_path), owner)
    if relative not in files:
        raise NotFound("download link not found")
    return FileResponse(files[relative])


@router.get("/training_runs/{model_id}")
async def get_training_run(model_id: str, request: Request) -> dict:
    ops = _ops(request)
    record = ops.checkpoints.run_record(model_id, _owner(request))
    return _training_run(ops, record)


@router.get("/training_runs")
async def list_training_runs(
    request: Request, limit: int = RUNS_PAGE, offset: int = 0, access_scope: str = "owned"
) -> dict:
    """The caller's runs from ``offset``, ``limit`` of them (the SDK pages with both until a
    page comes back short); each reads its checkpoints, so off the event loop. A caller sees
    only its own runs, whichever ``access_scope`` it names."""
    if limit < 1:
        raise BadRequest(f"limit: must be at least 1, got {limit}", field="limit")
    if offset < 0:
        raise BadRequest(f"offset: must be at least 0, got {offset}", field="offset")
    ops, owner = _ops(request), _owner(request)
    records = ops.checkpoints.runs(owner)
    page = records[offset : offset + limit]
    runs = await run_in_threadpool(lambda: [_training_run(ops, r) for r in page])
    cursor = {"offset": offset, "limit": limit, "total_count": len(records)}
    return {"training_runs": runs, "cursor": cursor}


def _training_run(ops: TinkerOps, record: dict) -> dict:
    checkpoints = ops.checkpoints.list(record["model_id"], record["owner"])
    last = {c["checkpoint_type"]: c for c in checkpoints}
    return {
        "training_run_id": record["model_id"],
        "base_model": record["base_model"],
        "model_owner": record["owner"] or "local",
        "is_lora": True,
        "lora_rank": record["lora_rank"],
        "last_request_time": last.get("training", {}).get("time")
        or datetime.fromtimestamp(record["created_at"], tz=timezone.utc).isoformat(),
        "last_checkpoint": last.get("training"),
        "last_sampler_checkpoint": last.get("sampler"),
    }


@router.post("/weights_info")
async def weights_info(request: Request) -> dict:
    owner = _owner(request)
    body = await _parse(request, bodies.WeightsInfoBody, "weights_info")
    path = TinkerPath.parse(body.tinker_path, field="tinker_path")
    record = _ops(request).checkpoints.run_record(path.model_id, owner)
    return {"base_model": record["base_model"], "is_lora": True, "lora_rank": record["lora_rank"]}
