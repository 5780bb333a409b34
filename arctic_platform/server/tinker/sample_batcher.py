"""Coalesce concurrent ``asample`` requests on one sampler into one ``generate`` call.

The cookbook samples each environment of a group with its own request (``num_samples=1``), so a
GRPO batch arrives as dozens of small requests at once. Run one by one, each would pay a full
decode loop; gathered, they decode together (one prefill per distinct prompt). Requests are
validated before they join a batch, so one bad request cannot fail the others.

The SDK sends a group's requests one after another over several connections, so they reach the
server spread over a few milliseconds (tens under load). A drain that started on the first one at
once would decode it alone and leave the rest to a second full decode loop, doubling the step's
sampling time (the benchmark measured it). So a drain first *lingers*: it waits until no request
has arrived for :data:`LINGER_GAP_S`, at most :data:`LINGER_MAX_S`, which costs a lone request
a few milliseconds against a decode loop of hundreds.

An RL loop sends the same burst every step (``G`` prompts, or ``G x n`` single samples), so the
sampler's recent drains say how many requests to expect: once as many requests are pending as the
largest of the sub-job's last :data:`BURST_HISTORY` drains collected, the drain waits only
:data:`LINGER_SETTLE_S` for more (a burst that grew still gathers while its requests keep coming)
instead of the full gap after the last one. What is sampled does not change, only when the drain
starts.

On a sampler whose running batch lets calls join mid-decode (the executor's ``overlaps``: our
torch sampler, in this process or a Ray replica, and the vLLM engine), none of that waiting is
needed: a drain starts at once, its generate runs beside
the sub-job's other generates, and a request that arrives a few milliseconds later starts its
own drain, which joins the running decode at its next step. A drain that first loads a
snapshot's weights (``load``, ``snapshot_loads.py``) still runs alone and lingers, as a weight
load must not interleave with other drains' decodes; the drains after it of the same snapshot
need no load and join the decode.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from arctic_platform.contract.problems import FieldError
from arctic_platform.contract.sampling_params import SamplingParams
from arctic_platform.server.errors import BadRequest, Conflict
from arctic_platform.server.tinker.snapshot_loads import SnapshotLoad

LINGER_GAP_S = 0.03
LINGER_MAX_S = 0.3
LINGER_SETTLE_S = 0.005
BURST_HISTORY = 8


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
    arrived: threading.Condition = field(init=False)
    pending: list[_Pending] = field(default_factory=list)
    scheduled: bool = False

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)


class SampleBatcher:
    """Per-sampler queues of pending requests (see module doc)."""

    def __init__(
        self,
        linger_gap_s: float = LINGER_GAP_S,
        linger_max_s: float = LINGER_MAX_S,
        linger_settle_s: float = LINGER_SETTLE_S,
    ):
        self._lock = threading.Lock()
        self._queuing = threading.Lock()  # deciding a drain's weights and queueing it
        self._queues: dict[str, _Queue] = {}
        # sampling sub-job -> how many requests its last drains collected (module doc)
        self._bursts: dict[str, deque[int]] = {}
        self.linger_gap_s = linger_gap_s
        self.linger_max_s = linger_max_s
        self.linger_settle_s = linger_settle_s

    def add(
        self,
        sub,
        prompt: list[int],
        params: dict[str, Any],
        prompt_logprobs: bool,
        submit: Callable[..., Future],
        *,
        joins: bool = False,
        key: str | None = None,
        load: SnapshotLoad | None = None,
    ) -> Future:
        """Queue a request on sampling sub-job ``sub``; resolves to ``(outputs, prompt_lps)``.

        ``submit(runner, alone=)`` queues ``runner`` on the sub-job (the Service's guarded
        queue); a drain is queued whenever the queue goes from empty to non-empty. ``joins``:
        the sub-job's generates join one running decode (module doc). Requests batch by ``key``
        (default: the sub-job); ``load``: the snapshot whose weights the drain needs, loaded
        first in a drain that must (before it lingers, while the group still arrives).
        """
        engine = sub.engine
        try:
            parsed = SamplingParams.from_request(params)
        except FieldError as exc:
            raise BadRequest(str(exc), field=exc.field) from None
        if any(not 0 <= t < engine.vocab_size for t in prompt):
            message = f"prompt: token ids must lie in [0, {engine.vocab_size})"
            raise BadRequest(message, field="prompt")
        item = _Pending(prompt, parsed, prompt_logprobs)
        key = key or sub.sub_job_id
        with self._lock:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = _Queue(key, sub.sub_job_id)
        with queue.lock:
            queue.pending.append(item)
            queue.arrived.notify_all()
            start = not queue.scheduled
            queue.scheduled = True
        if start:
            taken: list[_Pending] = []  # what this drain took, for _fail_all
            with self._queuing:  # a drain's plan for the weights holds at its place in the queue
                loads = load is not None and load.plan()
                linger = loads or not joins
                drained = submit(
                    lambda: self._drain(queue, engine, load, loads, linger, taken), alone=loads
                )
            drained.add_done_callback(lambda f: self._fail_all(queue, f, taken))
        return item.future

    def _drain(
        self, queue: _Queue, engine, load: SnapshotLoad | None, loads: bool, linger: bool, taken
    ) -> None:
        if loads:  # the batch's weights load while its requests still arrive
            load.load(engine)
        elif load is not None:
            load.check()
        with queue.lock:
            if linger:
                self._linger(queue)
            batch, queue.pending = queue.pending, []
            taken.extend(batch)
            queue.scheduled = False
        with self._lock:
            bursts = self._bursts.setdefault(queue.sub_job_id, deque(maxlen=BURST_HISTORY))
            bursts.append(len(batch))
        outputs = engine.generate([p.prompt for p in batch], [p.params for p in batch])
        start = 0
        for item in batch:
            mine = outputs[start : start + item.params.n]
            start += item.params.n
            scored = engine.prompt_logprobs(item.prompt) if item.prompt_logprobs else None
            item.future.set_result((mine, scored))
        self._forget_if_idle(queue)

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

    def _linger(self, queue: _Queue) -> None:
        """Wait (holding ``queue.lock``) while requests keep arriving (see module doc)."""
        deadline = time.monotonic() + self.linger_max_s
        with self._lock:
            expected = max(self._bursts.get(queue.sub_job_id, ()), default=0)
        seen = len(queue.pending)
        while (left := deadline - time.monotonic()) > 0:
            gap = self.linger_settle_s if 0 < expected <= seen else self.linger_gap_s
            queue.arrived.wait(min(gap, left))
            if len(queue.pending) == seen:
                return
            seen = len(queue.pending)

    @staticmethod
    def _fail_all(queue: _Queue, drained: Future, taken: list[_Pending]) -> None:
        """A drain that failed (or never ran: a cancelled job) fails the requests it held (or,
        before it took any, those waiting for it), with the error the Service mapped (a bad
        request stays the user's error)."""
        if drained.cancelled():
            exc: BaseException = Conflict("the sampler stopped before running the request")
        elif (exc := drained.exception()) is None:
            return
        with queue.lock:
            batch = [i for i in taken if not i.future.done()]
            if not taken:
                batch, queue.pending = queue.pending, []
                queue.scheduled = False
        for item in batch:
            item.future.set_exception(exc)
