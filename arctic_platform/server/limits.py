"""How much work one request may ask for, so that one tenant cannot hold the server with it.

A ``generate`` with ``n = 1_000_000`` or a training batch of millions of tokens is valid input that
would occupy an op slot for hours. The server refuses such requests before they are queued, with
413 ``limit_exceeded`` naming the limit and the flag that sets it. A tenant's uploads are bounded
the same way: bodies partly sent at once (429, since waiting helps) and bytes held in incomplete
chunk groups; its long polls waiting at once (429), each of which holds a connection; and the
bytes of its ops not yet finished (429; 413 for one op beyond the bound alone). Each limit is a
``serve`` flag with a default sized for one GPU server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from arctic_platform.server.errors import PayloadTooLarge, ServiceError, TooManyRequests

MIB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on one request's work and on one tenant's uploads (flag names are the field
    names with dashes)."""

    max_samples_per_request: int = 4096
    max_sample_tokens: int = 4_194_304  # sum over samples of max_tokens
    max_batch_rows: int = 8192
    max_batch_tokens: int = 4_194_304
    # Uploads (server/http_common.py, server/async_requests.py): seconds one request body may
    # take to arrive (256 MiB at under 1 MB/s), and per tenant over all its requests, the bodies
    # being read at once and the MiB held in incomplete Cortex chunk groups.
    body_read_timeout: float = 300.0
    # Seconds a request's head (request line and headers) may take from the connection's opening
    # or the request's first byte; a slower connection is closed (server/http_protocol.py).
    header_read_timeout: float = 30.0
    max_uploads_per_tenant: int = 8
    max_chunk_group_mb: int = 1024
    # Long polls (get-job's ``?wait_s=``, Tinker's ``retrieve_future``) one tenant may have
    # waiting at once: each holds a connection for up to a minute. The Tinker SDK is told to keep
    # at most half of them in sample requests (``/client/config``), so one client is not refused.
    max_long_polls_per_tenant: int = 1024
    # OpenAI requests one tenant may have under way at once: each holds its connection until
    # its answer (waiting for its model to start, then for its op). An RL rollout sends
    # thousands at once, more than a person polls for, hence a bound of its own.
    max_openai_requests_per_tenant: int = 4096
    # Tinker sessions one tenant may have open at once (created, not finished nor timed out):
    # a script opens one, so this is many scripts at once. A session costs little, but without a
    # bound a tenant creating them in a loop would grow the server's memory without end.
    max_tinker_sessions_per_tenant: int = 256
    # MiB of ops one tenant has submitted and not seen finish (queued, parked for their turn, or
    # running; server/pending_work.py): each holds its body until it ends, so without a bound a
    # tenant could queue bodies until the server runs out of memory. Eight of the largest bodies
    # (``--max-body-mb``) fit.
    max_pending_mb_per_tenant: int = 2048
    # MiB of finished ops' results each polling API (Cortex requests, Tinker futures) keeps for
    # its clients to fetch; past it the scope holding the most drops its oldest
    # (server/request_registry.py), so results nobody fetches cannot fill the server's memory.
    max_retained_results_mb: int = 4096
    # MiB of JSON in one body or DSSST1 header (server/http_common.py): parsed JSON costs several
    # times its size in Python objects, a tensor's bytes are only viewed. 64 MiB holds a generate
    # of 8192 prompts x 1024 tokens sent as JSON (about 40 MB).
    max_json_mb: int = 64

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
            message = f"{op}: {value} {what} exceed this server's limit of {bound}"
            raise limit_exceeded(message, limit=limit, value=value, maximum=bound)

    def check_uploads(self, uploading: int) -> None:
        """``uploading``: the tenant's bodies partly held (some bytes arrived, more to come),
        this one included (429 beyond the limit: the same request succeeds once one of them has
        arrived)."""
        self._per_tenant(
            "max_uploads_per_tenant",
            uploading,
            "request bodies being read",
            "of concurrent uploads per tenant",
        )

    def check_long_polls(self, waiting: int) -> None:
        """``waiting``: the tenant's long polls waiting, this one included (beyond the limit a
        get-job is answered at once instead, ``job_ops.settled_info``; a Tinker
        ``retrieve_future`` gets this 429, which the SDK backs off from and retries)."""
        self._per_tenant(
            "max_long_polls_per_tenant",
            waiting,
            "long polls waiting",
            "of long polls waiting per tenant",
        )

    def check_openai_requests(self, under_way: int) -> None:
        """``under_way``: the tenant's OpenAI requests not yet answered, this one included (429
        ``rate_limit_error`` beyond the limit, which the ``openai`` SDK backs off from)."""
        self._per_tenant(
            "max_openai_requests_per_tenant", under_way, "OpenAI requests under way", "per tenant"
        )

    def check_tinker_sessions(self, open_: int) -> None:
        """``open_``: the tenant's Tinker sessions open, this one included (429 beyond the
        limit: the same request succeeds once one has finished or timed out)."""
        self._per_tenant(
            "max_tinker_sessions_per_tenant", open_, "Tinker sessions open", "per tenant"
        )

    def _per_tenant(self, limit: str, count: int, what: str, of: str) -> None:
        """429 ``limit_exceeded`` when a tenant's ``count`` things at once (this one included)
        pass ``limit``: the same request succeeds once one of the others has ended."""
        bound = getattr(self, limit)
        if count > bound:
            message = (
                f"this tenant already has {count - 1} {what}, the server's limit {of} is {bound}"
            )
            raise limit_exceeded(
                message, limit=limit, value=count, maximum=bound, error=TooManyRequests
            )

    def check_pending(self, held: int, nbytes: int) -> None:
        """An op of ``nbytes`` from a tenant whose unfinished ops hold ``held`` bytes: 413 when
        it is beyond the limit alone (it never fits), 429 when it would fit once some finish."""
        bound = self.max_pending_mb_per_tenant * MIB
        if nbytes > bound:
            message = (
                f"this op holds {nbytes} bytes, more than this server's limit of "
                f"{self.max_pending_mb_per_tenant} MiB of unfinished ops per tenant"
            )
            raise limit_exceeded(
                message, limit="max_pending_mb_per_tenant", value=nbytes, maximum=bound
            )
        if held + nbytes > bound:
            message = (
                f"this tenant's unfinished ops hold {held} bytes; with this op's {nbytes} they "
                f"would exceed this server's limit of {self.max_pending_mb_per_tenant} MiB "
                "(retry once some have finished)"
            )
            raise limit_exceeded(
                message,
                limit="max_pending_mb_per_tenant",
                value=held + nbytes,
                maximum=bound,
                error=TooManyRequests,
            )

    def check_chunk_bytes(self, held: int, *, alone: bool = False) -> None:
        """``held``: bytes a tenant's incomplete chunk groups would hold with the chunk in
        question; ``alone``: the declared size of one frame by itself. Beyond the limit a frame
        alone is a 413 (it never fits); otherwise a 429, since the tenant's other groups
        completing or expiring makes room."""
        bound = self.max_chunk_group_mb * MIB
        if held > bound:
            whose = "a frame of" if alone else "this tenant's incomplete chunk groups would hold"
            message = (
                f"chunk groups: {whose} {held} bytes, over this server's limit of "
                f"{self.max_chunk_group_mb} MiB"
            )
            error = PayloadTooLarge if alone else TooManyRequests
            raise limit_exceeded(
                message, limit="max_chunk_group_mb", value=held, maximum=bound, error=error
            )

    def check_json(self, what: str, nbytes: int) -> None:
        """``nbytes`` of JSON (a body, or a DSSST1 frame's header) about to be parsed."""
        bound = self.max_json_mb * MIB
        if nbytes > bound:
            message = (
                f"{what}: {nbytes} bytes of JSON exceed this server's limit of "
                f"{self.max_json_mb} MiB (send tensors in a DSSST1 body)"
            )
            raise limit_exceeded(message, limit="max_json_mb", value=nbytes, maximum=bound)


def limit_exceeded(
    message: str,
    *,
    limit: str,
    value: int,
    maximum: int,
    error: type[ServiceError] = PayloadTooLarge,
) -> ServiceError:
    """The refusal of a request beyond ``limit`` (a field above): code ``limit_exceeded``, the
    message ending with the flag that sets the limit."""
    flag = "--" + limit.replace("_", "-")
    return error(
        f"{message} ({flag})", code="limit_exceeded", limit=limit, value=value, maximum=maximum
    )


def _count(value: Any) -> int:
    """A count from a body: an integer, or a float that is one (``5000.0``, which the engines
    take for 5000); anything else counts as 1 (the op's own validation rejects it)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1
