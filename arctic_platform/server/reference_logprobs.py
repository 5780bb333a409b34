"""Generate log-probs in the reference server's shape, for clients that did not ask for columns.

The engines report each generated token as ``{token_id, logprob, rank, top}`` (``top``: the ``k``
likeliest ``[token_id, logprob]`` pairs), which this project's client receives as tensor columns
(:mod:`arctic_platform.contract.generate_columns`). The reference server answers vLLM's
per-position shape instead, ``{token_id: {logprob, rank, decoded_token}}`` for the sampled token
and the ``k`` likeliest, and reference users index it that way; so a reference-form answer
(``{job_id, results}``) of the on-prem and Cortex APIs, and each sample a Cortex
``generate-stream`` delivers as an event, is rewritten here. ``decoded_token`` is the
token decoded on its own by the sub-job model's tokenizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any


@functools.lru_cache(maxsize=8)
def _tokenizer(model_name: str):
    from arctic_platform.engine.config import ModelConfig
    from arctic_platform.engine.models import load_tokenizer

    return load_tokenizer(ModelConfig(name=model_name))


def as_reference_logprobs(result: Mapping, model_name: str) -> Mapping:
    """``result`` (``{job_id, results}``) with every sample's log-probs in vLLM's shape."""
    results = result.get("results")
    if not isinstance(results, list):
        return result
    return {**result, "results": reference_samples(results, model_name)}


def reference_samples(samples: list, model_name: str) -> list:
    """``samples`` (generate's per-sample dicts, as a result holds them or a Cortex
    ``generate-stream`` delivers them as events) with their log-probs in vLLM's shape."""
    if not any(isinstance(s, Mapping) and s.get("logprobs") for s in samples):
        return samples
    tokenizer = _tokenizer(model_name)
    decode = functools.lru_cache(maxsize=None)(lambda token: tokenizer.decode([token]))
    shaped = []
    for sample in samples:
        entries = sample.get("logprobs") if isinstance(sample, Mapping) else None
        if entries:
            sample = {**sample, "logprobs": [_position(entry, decode) for entry in entries]}
        shaped.append(sample)
    return shaped


def _position(entry: Mapping, decode: Callable[[int], str]) -> dict[int, dict[str, Any]]:
    """One flat entry as ``{token_id: {logprob, rank, decoded_token}}``, sampled token first."""
    token = entry["token_id"]
    position = {
        token: {"logprob": entry["logprob"], "rank": entry["rank"], "decoded_token": decode(token)}
    }
    for place, (candidate, value) in enumerate(entry["top"], start=1):
        position.setdefault(
            candidate, {"logprob": value, "rank": place, "decoded_token": decode(candidate)}
        )
    return position
