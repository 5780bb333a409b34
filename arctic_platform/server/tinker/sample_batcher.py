"""Coalesce concurrent ``asample`` requests on one sampler into one ``generate`` call.

The cookbook samples each environment of a group with its own request (``num_samples=1``), so a
GRPO batch arrives as dozens of small requests at once. Requests are validated before they join a
batch, so one bad request cannot fail the others. Requests pending when a drain starts go to the
engine as one call; a drain starts as soon as a request finds none scheduled, without waiting for
stragglers: a request that arrives while a drain decodes starts a drain of its own, which runs
concurrently (the Service lets generates overlap on a batching sampler) and joins the running
decode at its next step (the sampler's continuous batching, :mod:`arctic_platform.engine.
sampler_core`). So a group spread over some milliseconds still decodes as one batch, and a lone
request waits for nothing.

A drain of a sampler snapshot first loads the snapshot's weights (``before``) unless they are the
ones loaded. A load waits until the calls already in the engine have finished (the sampler runs
weight loads between calls), and each sub-job's drains load and submit under one lock, so no
call decodes with another snapshot's weights. On an engine without ``submit`` (the vLLM backend,
Ray replicas) drains run one at a time and call ``generate``.
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
    key: str
    sub_job_id: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: list[_Pending] = field(default_factory=list)
    scheduled: bool = False


class SampleBatcher:
    """Per-sampler queues of pending requests (see module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, _Queue] = {}
        # sampling sub-job -> the lock its drains load weights and submit under (module doc)
        self._submitting: dict[str, threading.Lock] = {}

    def add(
        self,
        sub,
        prompt: list[int],
        params: dict[str, Any],
        prompt_logprobs: bool,
        submit: Callable[[Callable[[], None]], Future],
        *,
        key: str | None = None,
        before: Callable[[Any], None] | None = None,
    ) -> Future:
        """Queue a request on sampling sub-job ``sub``; resolves to ``(outputs, prompt_lps)``.

        ``submit(runner)`` queues ``runner`` on the sub-job (the Service's guarded queue); a
        drain is queued whenever the queue goes from empty to non-empty. Requests batch by
        ``key`` (default: the sub-job); ``before(engine)`` runs first in the drain (a sampler
        snapshot loads its weights there).
        """
        engine = sub.engine
        try:
            parsed = SamplingParams.from_request(params)
        except ValueError as exc:  # EngineInputError is a ValueError naming the field
            raise BadRequest(f"sampling_params: {exc}") from None
        if any(not 0 <= t < engine.vocab_size for t in prompt):
            raise BadRequest(f"prompt: token ids must lie in [0, {engine.vocab_size})")
        item = _Pending(prompt, parsed, prompt_logprobs)
        key = key or sub.sub_job_id
        with self._lock:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = _Queue(key, sub.sub_job_id)
            submitting = self._submitting.setdefault(sub.sub_job_id, threading.Lock())
        with queue.lock:
            queue.pending.append(item)
            start = not queue.scheduled
            queue.scheduled = True
        if start:
            taken: list[_Pending] = []
            drained = submit(lambda: self._drain(queue, engine, before, submitting, taken))
            drained.add_done_callback(lambda f: self._fail_all(queue, taken, f))
        return item.future

    def _drain(self, queue: _Queue, engine, before, submitting: threading.Lock, taken) -> None:
        with submitting:
            if before is not None:
                before(engine)
            with queue.lock:
                batch, queue.pending = queue.pending, []
                queue.scheduled = False
            taken.extend(batch)
            prompts, params = [p.prompt for p in batch], [p.params for p in batch]
            start = getattr(engine, "submit", None)
            if start is not None:
                call = start(prompts, params)
            else:
                outputs = engine.generate(prompts, params)
        self._forget_if_idle(queue)
        if start is not None:
            outputs = call.result()
        first = 0
        for item in batch:
            mine = outputs[first : first + item.params.n]
            first += item.params.n
            scored = engine.prompt_logprobs(item.prompt) if item.prompt_logprobs else None
            item.future.set_result((mine, scored))

    def _forget_if_idle(self, queue: _Queue) -> None:
        """Drop a queue nothing waits on: a Tinker run batches each sampler snapshot under its
        own key, so kept queues would grow by one per step. A request that already holds the
        dropped queue still schedules its own drain on it (``scheduled`` is False), so nothing
        is lost; the next request for the key starts a new queue."""
        with queue.lock:
            if queue.pending or queue.scheduled:
                return
            with self._lock:
                if self._queues.get(queue.key) is queue:
                    del self._queues[queue.key]

    @staticmethod
    def _fail_all(queue: _Queue, taken: list[_Pending], drained: Future) -> None:
        """A drain that failed (or never ran: a cancelled job) fails the requests it held, with
        the error the Service mapped (a bad request stays the user's error)."""
        if drained.cancelled():
            exc: BaseException = Conflict("the sampler stopped before running the request")
        elif (exc := drained.exception()) is None:
            return
        batch = [i for i in taken if not i.future.done()]
        if not taken:  # it never took its requests: they are still pending
            with queue.lock:
                batch, queue.pending = queue.pending, []
                queue.scheduled = False
        for item in batch:
            item.future.set_exception(exc)
