"""Who runs the sampler's running batch, and when a ``generate`` call joins it.

``generate`` calls may come from several threads at once (the server runs a sampling sub-job's
generate ops side by side). Each call queues its samples and waits; there is no thread of the
loop's own: **whichever waiting caller finds the loop free drives it** — it admits what fits
(:meth:`RunningBatch.plan`/``admit``), samples one token for every row, hands each finished
sequence to its call, and runs the next forward — until its own call is over; then it lets go
and another waiting caller takes over. So a call that arrives while a decode runs joins it at the
next step, and a short call returns as soon as its sequences finish, not when the batch does.

Other work on the engine (``load_weights``, ``sleep``, ``wake``, prompt log-probs) goes through
:meth:`DecodeLoop.exclusive`: it queues behind the calls that arrived before it, waits until the
running batch is empty (those calls finish on the old weights), runs alone, and the calls that
arrived after it are admitted only then (they see the new weights). Arrival order is kept.

Stopping: each call carries the :class:`~arctic_platform.engine.cancellation.CancelToken` s of
the op it runs in. The driver looks at every call's tokens before each step and ends a stopped
call alone (its rows leave the batch, the call raises ``OpCancelled``); a stopped call that is
still waiting to join notices within :data:`POLL_S` by itself. An exception while stepping (a
model failure) ends every call in the batch with that exception and empties the batch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

from arctic_platform.engine import cancellation
from arctic_platform.engine.running_batch import Finished, RunningBatch, Slice

T = TypeVar("T")

# How often a call waiting to join looks at its own cancel tokens.
POLL_S = 0.05


class _Call:
    """One ``generate`` call: its samples still waiting to join, its outputs, how it ended."""

    def __init__(self, slices: list[Slice], offsets: dict[int, int], total: int) -> None:
        for piece in slices:
            piece.owner = self
        self.waiting = deque(slices)
        self.offsets = offsets  # request index -> its first output's position
        self.outputs: list[Finished | None] = [None] * total
        self.left = total
        self.error: BaseException | None = None
        self.joined = False  # some of its samples are (or were) in the batch
        self.tokens = cancellation.current_tokens()

    @property
    def ended(self) -> bool:
        return self.error is not None or self.left == 0


class _Exclusive:
    """A place in the queue for work that runs alone (see the module doc)."""


class DecodeLoop:
    """The queue of calls in front of one :class:`RunningBatch` (see the module doc).

    ``ready()`` runs before samples join an empty batch (the sampler checks its weights are
    complete and wakes a sleeping engine there); what it raises ends the joining calls.
    """

    def __init__(self, batch: RunningBatch, ready: Callable[[], None]) -> None:
        self.batch = batch
        self._ready = ready
        self._cond = threading.Condition()
        self._queue: deque[_Call | _Exclusive] = deque()
        self._joined: set[_Call] = set()  # calls with rows in the batch
        self._driving = False
        self._rows_now = 0  # live rows after the last step, as the driver saw them

    def state(self) -> dict:
        """What the loop holds now: rows decoding, calls and exclusive work waiting, joins."""
        with self._cond:
            waiting = sum(isinstance(item, _Call) for item in self._queue)
            return {
                "running_rows": self._rows_now,
                "running_calls": len(self._joined),
                "waiting_calls": waiting,
                "waiting_exclusive": len(self._queue) - waiting,
                "joins": self.batch.joins,
            }

    def run(self, slices: list[Slice], offsets: dict[int, int], total: int) -> list[Finished]:
        """Decode ``slices`` (``total`` samples) with whatever else runs; outputs in order."""
        call = _Call(slices, offsets, total)
        with self._cond:
            self._queue.append(call)
            self._cond.notify_all()
        while True:
            with self._cond:
                while not call.ended and (self._driving or not self._work()):
                    if not call.joined and (reason := cancellation.reason_of(call.tokens)):
                        self._end(call, cancellation.OpCancelled(reason))
                        break
                    self._cond.wait(POLL_S)
                if call.ended:
                    break
                self._driving = True
            try:
                self._drive(call)
            finally:
                with self._cond:
                    self._driving = False
                    self._cond.notify_all()
        if call.error is not None:
            raise call.error
        return call.outputs

    def exclusive(self, work: Callable[[], T]) -> T:
        """Run ``work`` alone, in arrival order with the calls (see the module doc)."""
        mark = _Exclusive()
        with self._cond:
            self._queue.append(mark)
            while self._queue[0] is not mark or self._driving or not self.batch.empty:
                self._cond.wait()
            self._driving = True
        try:
            return work()
        finally:
            with self._cond:
                self._queue.popleft()
                self._driving = False
                self._cond.notify_all()

    def _work(self) -> bool:
        """Whether a driver has something to do (under the lock)."""
        return not self.batch.empty or bool(self._queue and isinstance(self._queue[0], _Call))

    def _drive(self, call: _Call) -> None:
        """Step the batch until ``call`` is over, or there is nothing this driver may do."""
        with torch.inference_mode(), cancellation.deferred():
            while not call.ended:
                joining: list[Slice] = []
                try:
                    with self._cond:
                        # Ending a stopped call compacts the batch, which can fail as a step can.
                        self._end_stopped()
                        joining = self._take()
                    if not joining and self.batch.empty:
                        return  # exclusive work is next, or this call has ended
                    if joining and self.batch.empty:
                        self._ready()
                    if joining:
                        self.batch.admit(joining)
                    finished = self.batch.sample()
                except Exception as exc:
                    self._fail_batch(exc, joining)
                    continue
                with self._cond:
                    self._deliver(finished)
                try:
                    self.batch.advance()
                except Exception as exc:
                    self._fail_batch(exc, [])

    def _take(self) -> list[Slice]:
        """The waiting samples that join now (under the lock): arrival order, up to exclusive
        work, as many as fit."""

        def waiting():
            for item in self._queue:
                if not isinstance(item, _Call):
                    return
                yield from item.waiting

        joining = self.batch.plan(waiting())
        for piece in joining:
            owner: _Call = piece.owner
            head = owner.waiting[0]
            if piece.count == head.count:
                owner.waiting.popleft()
            else:
                head.first += piece.count
                head.count -= piece.count
            owner.joined = True
            self._joined.add(owner)
        while self._queue and isinstance(self._queue[0], _Call) and not self._queue[0].waiting:
            self._queue.popleft()
        return joining

    def _deliver(self, finished: list[Finished]) -> None:
        self._rows_now = self.batch.live
        for done in finished:
            owner: _Call = done.owner
            if owner.ended:
                continue
            owner.outputs[owner.offsets[done.request.index] + done.sample] = done
            owner.left -= 1
            if owner.left == 0:
                self._joined.discard(owner)
        if finished:
            self._cond.notify_all()

    def _end_stopped(self) -> None:
        """End the calls whose op was cancelled (under the lock)."""
        queued = [item for item in self._queue if isinstance(item, _Call)]
        for owner in [*self._joined, *queued]:
            if not owner.ended and (reason := cancellation.reason_of(owner.tokens)):
                self._end(owner, cancellation.OpCancelled(reason))

    def _end(self, owner: _Call, error: BaseException) -> None:
        """End ``owner`` with ``error`` (under the lock): out of the queue and the batch."""
        owner.error = error
        if owner in self._queue:
            self._queue.remove(owner)
        if owner in self._joined:
            self._joined.discard(owner)
            self.batch.drop(owner)
            self._rows_now = self.batch.live
        self._cond.notify_all()

    def _fail_batch(self, exc: Exception, joining: list[Slice]) -> None:
        """A step failed: every call in the batch (and those joining it) ends with ``exc``.

        The batch is forgotten first: a step can fail half-way through a join (rows admitted,
        their tokens not yet written), and ending a call on such a batch would compact rows
        that are not all there."""
        with self._cond:
            owners = {*self._joined, *(piece.owner for piece in joining)}
            self.batch.clear()
            self._rows_now = 0
            for owner in owners:
                if not owner.ended:
                    self._end(owner, exc)
            self._cond.notify_all()
