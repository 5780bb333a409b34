"""How much work one request may ask for, so that one tenant cannot hold the server with it.

A ``generate`` with ``n = 1_000_000`` or a training batch of millions of tokens is valid input that
would occupy an op slot for hours. The server refuses such requests before they are queued, with
413 ``limit_exceeded`` naming the limit and the flag that sets it. Each limit is a ``serve`` flag
with a default sized for one GPU server (:data:`DEFAULT_LIMITS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arctic_platform.server.errors import PayloadTooLarge


@dataclass(frozen=True)
class ServerLimits:
    """Per-request work bounds (flag names are the field names with dashes)."""

    max_samples_per_request: int = 4096
    max_sample_tokens: int = 4_194_304  # sum over samples of max_tokens
    max_batch_rows: int = 8192
    max_batch_tokens: int = 4_194_304

    def check_generate(self, op: str, prompts: list, sampling_params: Any, context: int) -> None:
        """``n`` summed over prompts, and ``n x max_tokens`` (the context when unset)."""
        per_prompt = sampling_params
        if not isinstance(per_prompt, list):
            per_prompt = [sampling_params] * len(prompts)
        samples = tokens = 0
        for params in per_prompt:
            params = params if isinstance(params, Mapping) else {}
            n = _count(params.get("n", 1))
            samples += n
            tokens += n * _count(params.get("max_tokens") or context)
        self._bound(op, "samples", samples, "max_samples_per_request")
        self._bound(op, "sample tokens (n x max_tokens)", tokens, "max_sample_tokens")

    def check_batch(self, op: str, batch: Mapping) -> int:
        """Rows and tokens of a training/forward batch (from its largest 2-d tensor); returns the
        batch's token count."""
        shapes = [tuple(getattr(v, "shape", ())) for v in batch.values()]
        two_d = [s for s in shapes if len(s) == 2]
        if not two_d:
            return 0
        rows, width = max(two_d, key=lambda s: s[0] * s[1])
        return self.check_batch_shape(op, rows, width)

    def check_batch_shape(self, op: str, rows: int, width: int) -> int:
        """A ``[rows, width]`` batch, for callers that check it before building it (Tinker
        datums); returns its token count."""
        self._bound(op, "batch rows", rows, "max_batch_rows")
        self._bound(op, "batch tokens", rows * width, "max_batch_tokens")
        return rows * width

    def check_rows(self, op: str, rows: int) -> None:
        self._bound(op, "rows", rows, "max_batch_rows")

    def _bound(self, op: str, what: str, value: int, limit: str) -> None:
        bound = getattr(self, limit)
        if value > bound:
            raise limit_exceeded(f"{op}: {value} {what}", value, limit, bound)


def limit_exceeded(
    what: str, value: int, limit: str, bound: int, unit: str = ""
) -> PayloadTooLarge:
    """The 413 of every work limit: ``what`` exceeds ``bound``, set by the ``serve`` flag of the
    same name as ``limit``."""
    flag = "--" + limit.replace("_", "-")
    return PayloadTooLarge(
        f"{what} exceed this server's limit of {bound}{unit} ({flag})",
        code="limit_exceeded",
        limit=limit,
        value=value,
        maximum=bound,
    )


def _count(value: Any) -> int:
    """A count from a body; non-integers count as 1 (the op's own validation rejects them)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1
