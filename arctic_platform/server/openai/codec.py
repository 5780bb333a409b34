"""OpenAI requests as our op bodies, and op results as OpenAI's answers.

The ``generate`` op's samples (``text``, ``token_ids``, ``finish_reason``, ``prompt_len``,
``logprobs: [{token_id, logprob, top: [[id, logprob], ...]}]``) and the ``log-probs`` op's scored
prompts (``prompt_token_ids``, ``logprobs``, ``top_logprobs``, None for the first token) carry
all an answer needs; the tokenizer only spells token ids for ``logprobs``.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from arctic_platform.contract.engine_protocols import LogProbEngineProtocol, SamplingEngineProtocol
from arctic_platform.engine.builtin import resolve_model_path
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.openai.bodies import ChatRequest, CompletionRequest


def sampling_params(request: CompletionRequest | ChatRequest) -> dict[str, Any]:
    """The ``generate`` op's sampling parameters (vLLM's names) for ``request``."""
    if isinstance(request, ChatRequest):
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        max_tokens, logprobs = request.max_tokens, request.logprobs
    stop = request.stop
    return {
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": max_tokens,
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        "seed": request.seed,
        "logprobs": logprobs,
    }


def usage(samples: list[dict], prompt_lengths: list[int], firsts: list[dict]) -> dict:
    """Token counts; ``firsts``: one sample of each prompt, whose ``cached_prompt_tokens`` (the
    prompt tokens the engine's prompt cache provided) make ``prompt_tokens_details``."""
    completion = sum(len(s["token_ids"]) for s in samples)
    prompt = sum(prompt_lengths)
    cached = sum(s.get("cached_prompt_tokens", 0) for s in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _header(kind: str, model: str) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


# -- completions ------------------------------------------------------------------------------


class Spelling:
    """Token ids as strings (``logprobs.tokens``, the keys of ``top_logprobs``, echoed token-id
    prompts), with the model's tokenizer (:func:`tokenizer_of`), looked up only when an answer
    needs one."""

    def __init__(self, engine, weights: str) -> None:
        self._engine = engine
        self._weights = weights

    def __call__(self, token_id: int) -> str:
        return self.text([token_id])

    def text(self, token_ids: list[int]) -> str:
        tokenizer = tokenizer_of(self._engine, self._weights)
        return tokenizer.decode(token_ids, clean_up_tokenization_spaces=False)


def tokenizer_of(engine: SamplingEngineProtocol | LogProbEngineProtocol, weights: str):
    """The tokenizer of the model at ``weights``: the engine's own (ours and vLLM's hold one), or,
    for an engine in a Ray actor (``serve --ray``), one loaded here from the model's folder."""
    tokenizer = engine.tokenizer
    return tokenizer if tokenizer is not None else _local_tokenizer(weights)


@functools.lru_cache(maxsize=16)
def _local_tokenizer(weights: str):
    """The tokenizer files of ``weights`` (a folder, a built-in or hub model), loaded once. A
    server whose Ray workers hold model files its own machine cannot read answers a 400."""
    from transformers import AutoTokenizer  # only here: importing the app loads no transformers

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path(weights))
    except (OSError, ValueError) as exc:
        raise BadRequest(
            f"model: its tokenizer cannot be read on the API server ({exc}); chat, logprobs and "
            "echoed token ids need it here, where the engines run in Ray actors (serve --ray)",
            code="unsupported_parameter",
            param="model",
        ) from exc


def completion(
    request: CompletionRequest,
    prompts: list[str | list[int]],
    samples: list[dict],
    scored: list[dict] | None,
    spell: Spelling,
) -> dict:
    """The ``text_completion`` answer: ``n`` choices per prompt, in prompt order. ``samples``
    is empty for ``max_tokens=0`` (echo only); ``scored`` holds the prompts' log-probs (echo)."""
    n = request.n
    choices = []
    for index in range(len(prompts) * n):
        p = index // n
        sample = samples[index] if samples else None
        text = sample["text"] if sample else ""
        logprobs = None
        if request.logprobs is not None:
            logprobs = _completion_logprobs(sample, scored[p] if request.echo else None, spell)
        if request.echo:
            prompt = prompts[p]
            text = (prompt if isinstance(prompt, str) else spell.text(prompt)) + text
        choices.append(
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": sample["finish_reason"] if sample else "length",
            }
        )
    firsts = [samples[p * n] for p in range(len(prompts))] if samples else []
    if scored is not None:
        lengths = [len(s["prompt_token_ids"]) for s in scored]
    else:
        lengths = [s["prompt_len"] for s in firsts]
    return {
        **_header("text_completion", request.model),
        "choices": choices,
        "usage": usage(samples, lengths, firsts),
    }


def _completion_logprobs(sample: dict | None, scored: dict | None, spell: Spelling) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` over the echoed prompt (when
    ``scored``) and the sample; as OpenAI's, each ``top_logprobs`` holds the chosen token too."""
    ids: list[int] = []
    values: list[float | None] = []
    tops: list[dict | None] = []
    if scored is not None:
        ids += scored["prompt_token_ids"]
        values += scored["logprobs"]
        tops += [
            None if top is None else _top(top, spell) | {spell(token_id): value}
            for token_id, value, top in zip(
                scored["prompt_token_ids"], scored["logprobs"], scored["top_logprobs"], strict=True
            )
        ]
    for entry in (sample or {}).get("logprobs") or []:
        ids.append(entry["token_id"])
        values.append(entry["logprob"])
        tops.append(_top(entry["top"], spell) | {spell(entry["token_id"]): entry["logprob"]})
    tokens = [spell(i) for i in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _top(pairs: list, spell: Spelling) -> dict[str, float]:
    return {spell(int(token_id)): float(value) for token_id, value in pairs}


# -- chat ---------------------------------------------------------------------------------


def chat(request: ChatRequest, samples: list[dict], spell: Spelling) -> dict:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": s["text"]},
            "logprobs": _chat_logprobs(s, spell) if request.logprobs else None,
            "finish_reason": s["finish_reason"],
        }
        for i, s in enumerate(samples)
    ]
    return {
        **_header("chat.completion", request.model),
        "choices": choices,
        "usage": usage(samples, [s["prompt_len"] for s in samples[:1]], samples[:1]),
    }


def _chat_logprobs(sample: dict, spell: Spelling) -> dict:
    def entry(token_id: int, value: float) -> dict:
        token = spell(token_id)
        return {"token": token, "logprob": value, "bytes": list(token.encode())}

    return {
        "content": [
            entry(e["token_id"], e["logprob"])
            | {"top_logprobs": [entry(int(t), float(v)) for t, v in e["top"]]}
            for e in sample.get("logprobs") or []
        ]
    }


# -- server-sent events -------------------------------------------------------------------


def events(answer: dict, *, include_usage: bool) -> Iterator[str]:
    """A finished answer as OpenAI's stream: one chunk per choice (the engine returns whole
    samples, so a choice's text arrives at once), the usage chunk when asked, ``[DONE]``."""
    chat_answer = answer["object"] == "chat.completion"
    header = {k: answer[k] for k in ("id", "created", "model")}
    header["object"] = "chat.completion.chunk" if chat_answer else "text_completion"
    for choice in answer["choices"]:
        if chat_answer:
            message = choice["message"]
            choice = {
                "index": choice["index"],
                "delta": {"role": message["role"], "content": message["content"]},
                "logprobs": choice["logprobs"],
                "finish_reason": choice["finish_reason"],
            }
        yield _event({**header, "choices": [choice]})
    if include_usage:
        yield _event({**header, "choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"


def _event(value: dict) -> str:
    return f"data: {json.dumps(value)}\n\n"
