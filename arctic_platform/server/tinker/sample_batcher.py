"""Coalesce concurrent ``asample`` requests on one sampler into one ``generate`` call.

The cookbook samples each environment of a group with its own request (``num_samples=1``), so a
GRPO batch arrives as dozens of small requests at once. Run one by one, each would pay a full
decode loop; gathered, they decode together (the sampler batches prompts in waves). Requests are
validated before they join a batch, so one bad request cannot fail the others.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from arctic_platform.engine.sampling_params import SamplingParams
from arctic_platform.server.errors import BadRequest, Conflict


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    prompt_logprobs: bool
    future: Future = field(default_factory=Future)


@dataclass
class _Queue:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[_Pending] = field(default_factory=list)
    in_flight: list[_Pending] = field(default_factory=list)
    scheduled: bool = False


class SampleBatcher:
    """Per-sampler queues of pending requests (see module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, _Queue] = {}

    def add(
        self,
        sub,
        prompt: list[int],
        params: dict[str, Any],
        prompt_logprobs: bool,
        submit: Callable[[Callable[[], None]], Future],
    ) -> Future:
        """Queue a request on sampling sub-job ``sub``; resolves to ``(outputs, prompt_lps)``.

        ``submit(runner)`` queues ``runner`` on the sub-job (the Service's guarded queue); a
        drain is queued whenever the queue goes from empty to non-empty.
        """
        engine = sub.engine
        try:
            parsed = SamplingParams.from_request(params)
        except ValueError as exc:  # EngineInputError is a ValueError naming the field
            raise BadRequest(f"sampling_params: {exc}") from None
        if any(not 0 <= t < engine.vocab_size for t in prompt):
            raise BadRequest(f"prompt: token ids must lie in [0, {engine.vocab_size})")
        item = _Pending(prompt, parsed, prompt_logprobs)
        with self._lock:
            queue = self._queues.setdefault(sub.sub_job_id, _Queue())
        with queue.lock:
            queue.pending.append(item)
            start = not queue.scheduled
            queue.scheduled = True
        if start:
            drained = submit(lambda: self._drain(queue, engine))
            drained.add_done_callback(lambda f: self._fail_all(queue, f))
        return item.future

    @staticmethod
    def _drain(queue: _Queue, engine) -> None:
        with queue.lock:
            batch, queue.pending = queue.pending, []
            queue.in_flight = batch
            queue.scheduled = False
        outputs = engine.generate([p.prompt for p in batch], [p.params for p in batch])
        start = 0
        for item in batch:
            mine = outputs[start : start + item.params.n]
            start += item.params.n
            scored = engine.prompt_logprobs(item.prompt) if item.prompt_logprobs else None
            item.future.set_result((mine, scored))

    @staticmethod
    def _fail_all(queue: _Queue, drained: Future) -> None:
        """A drain that failed (or never ran: a cancelled job) fails the requests it held, with
        the error the Service mapped (a bad request stays the user's error)."""
        if drained.cancelled():
            exc: BaseException = Conflict("the sampler stopped before running the request")
        elif (exc := drained.exception()) is None:
            return
        with queue.lock:
            batch = [i for i in queue.in_flight if not i.future.done()]
            if not batch:
                batch, queue.pending = queue.pending, []
                queue.scheduled = False
            queue.in_flight = []
        for item in batch:
            item.future.set_exception(exc)
