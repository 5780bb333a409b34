"""The routes: ``POST completions``, ``POST chat/completions``, ``GET models``, mounted under
``/v1`` (plain OpenAI base URLs) and ``/oai/api/v1`` (Tinker's).

Auth: a server token as ``Authorization: Bearer`` (what the ``openai`` SDK sends) or
``X-API-Key``. Each request runs its ops through ``Service.submit`` on the caller's model job
(:func:`.models.model_sub_job`); a request refused by the work limits is refused before a job is
started for it. A streamed request is answered as a stream only once its op succeeded, so a
refusal keeps its status code.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from arctic_platform.contract.ops import OpName
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.http_common import json_of, op_result, read_body
from arctic_platform.server.openai import codec, models
from arctic_platform.server.openai.bodies import ChatRequest, CompletionRequest, parse
from arctic_platform.server.openai.errors import OpenAIRoute
from arctic_platform.server.ops import check_generate

PREFIXES = ("/v1", "/oai/api/v1")
API_KEY_HEADER = "x-api-key"

router = APIRouter(route_class=OpenAIRoute)


def _owner(request: Request) -> str | None:
    """The caller's owner id from ``Authorization: Bearer`` or ``X-API-Key``."""
    header = request.headers.get("authorization")
    key = request.headers.get(API_KEY_HEADER)
    if not header and key:
        header = f"Bearer {key}"
    return request.app.state.auth.owner(header)


async def _serve(request: Request, model, what: str, run):
    """Parse the body as ``model``, await ``run(service, tinker, owner, body)`` and answer with
    its result: JSON, or server-sent events for ``stream``. Until its answer (waiting for its
    model to start, then for its op) the request holds its connection, so a tenant has at most
    ``--max-openai-requests-per-tenant`` under way (one more is a 429 ``rate_limit_error``)."""
    owner = _owner(request)
    body = parse(model, await json_of(request, await read_body(request), what=what))
    state = request.app.state
    with state.openai_requests.hold(owner, state.service.limits):
        answer = await run(state.service, state.tinker, owner, body)
    if not body.stream:
        return answer
    usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(
        codec.events(answer, include_usage=usage), media_type="text/event-stream"
    )


@router.get("/models")
async def list_models(request: Request) -> dict:
    owner = _owner(request)
    names = await run_in_threadpool(
        models.listed, request.app.state.service, request.app.state.tinker, owner
    )
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "owned_by": "arctic-platform"} for name in names],
    }


@router.post("/completions")
async def completions(request: Request):
    return await _serve(request, CompletionRequest, "completions", _complete)


@router.post("/chat/completions")
async def chat_completions(request: Request):
    return await _serve(request, ChatRequest, "chat/completions", _chat)


async def _complete(service, tinker, owner, body: CompletionRequest) -> dict:
    """``generate`` for the samples and, with ``echo`` (and ``logprobs``, or ``max_tokens=0``:
    scoring only), ``log-probs`` for the prompt's log-probs (on a log-prob job of the same
    weights: the engine that scores as training does); the generated tokens then continue the
    prompt tokens that were scored."""
    if body.max_tokens == 0 and not body.echo:
        raise BadRequest(
            "max_tokens: 0 generates nothing; use echo=true to score", param="max_tokens"
        )
    prompts = body.prompts()
    params = codec.sampling_params(body)
    check_generate(service, None, OpName.GENERATE, prompts, params)
    model = await run_in_threadpool(models.resolve, service, tinker, owner, body.model)
    scored, spell, token_prompts = None, None, prompts
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        top_k = max(1, body.logprobs or 0)  # scoring alone (max_tokens=0) may name none
        async with models.model_sub_job(service, tinker, owner, model, "log_prob") as sub:
            op = {"prompts": prompts, "top_k": top_k}
            scored = (await op_result(service, sub, OpName.LOG_PROBS, op))["results"]
            spell = codec.Spelling(sub.engine, model.weights)
        token_prompts = [s["prompt_token_ids"] for s in scored]
    samples: list[dict] = []
    if body.max_tokens > 0:
        async with models.model_sub_job(service, tinker, owner, model, "sampling") as sub:
            op = {"prompts": token_prompts, "sampling_params": params}
            samples = (await op_result(service, sub, OpName.GENERATE, op))["results"]
            spell = codec.Spelling(sub.engine, model.weights)
    return await run_in_threadpool(codec.completion, body, prompts, samples, scored, spell)


async def _chat(service, tinker, owner, body: ChatRequest) -> dict:
    """The messages rendered with the model's chat template, then ``generate``."""
    params = codec.sampling_params(body)
    check_generate(service, None, OpName.GENERATE, [""], params)
    model = await run_in_threadpool(models.resolve, service, tinker, owner, body.model)
    async with models.model_sub_job(service, tinker, owner, model, "sampling") as sub:
        prompt = await run_in_threadpool(_chat_prompt, sub, model, body)
        op = {"prompts": [prompt], "sampling_params": params}
        samples = (await op_result(service, sub, OpName.GENERATE, op))["results"]
        spell = codec.Spelling(sub.engine, model.weights)
    return await run_in_threadpool(codec.chat, body, samples, spell)


def _chat_prompt(sub, model, body: ChatRequest) -> str:
    """The messages rendered with the model's chat template (its tokenizer may load from disk)."""
    tokenizer = codec.tokenizer_of(sub.engine, model.weights)
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            f"messages: model {body.model!r} has no chat template; use /completions",
            param="messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
