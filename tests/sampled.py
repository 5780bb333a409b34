"""Generate outputs as what was sampled, for tests that compare calls.

Every sample output carries ``cached_prompt_tokens``: how many of its prompt's tokens the engine's
prompt cache provided. That belongs to the call, not to what was sampled: the same prompt sent
again is a cache hit (vLLM's ``num_cached_tokens`` differs between runs the same way), so a test
comparing two calls' samples compares them without it.
"""

from __future__ import annotations


def sampled(outputs: list[dict]) -> list[dict]:
    """``outputs`` without ``cached_prompt_tokens``, each checked to lie in ``[0, prompt_len]``."""
    for output in outputs:
        cached = output["cached_prompt_tokens"]
        assert isinstance(cached, int) and 0 <= cached <= output["prompt_len"], output
    return [{k: v for k, v in o.items() if k != "cached_prompt_tokens"} for o in outputs]
