"""Which snapshot's weights a run's sampling sub-job holds, and which sampling drains load one.

A run's sampling sub-job serves every snapshot its sampling clients were made from
(``state.py``), and a drain of a snapshot's requests (``sample_batcher.py``) must find that
snapshot's weights loaded. A load runs alone on the sub-job's queue (after the generates queued
before it, before those queued after it); sampling does not need to. So a drain queued when the
sub-job's *planned* weights (what it will hold once everything queued so far has run: the last
load queued, else what is loaded) are its own snapshot's needs no load, and decodes beside the
sub-job's other generates; only a drain of another snapshot loads, alone. An RL step's requests
on a fresh snapshot thus load once, and the requests that miss that drain join the decode instead
of queueing behind it.

A load that fails forgets the plan, so the next drain loads again; a drain that planned on no
load and finds other weights at its turn (a load before it failed) is refused with 409 rather
than sampled from weights that are not its snapshot's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from arctic_platform.server.errors import Conflict

# (training run model id, snapshot number)
SnapshotId = tuple[str, int]


class SnapshotWeights:
    """The loaded and the planned snapshot of each sampling sub-job (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, SnapshotId] = {}
        self._planned: dict[str, SnapshotId] = {}

    def load_of(self, sub_job_id: str, wanted: SnapshotId, weights: Any) -> SnapshotLoad:
        """What a drain of snapshot ``wanted`` (whose ``WeightSnapshot`` is ``weights``) does
        about the sub-job's weights."""
        return SnapshotLoad(self, sub_job_id, wanted, weights)


@dataclass(frozen=True)
class SnapshotLoad:
    """One drain's snapshot: :meth:`plan` as it is queued, then :meth:`load` or :meth:`check`
    at its turn (see module doc)."""

    weights: SnapshotWeights
    sub_job_id: str
    wanted: SnapshotId
    snapshot: Any

    def plan(self) -> bool:
        """Whether the drain being queued now must load (it then becomes the plan). Its caller
        queues the drain before another drain of the sub-job plans."""
        state = self.weights
        with state._lock:
            planned = state._planned.get(self.sub_job_id, state._loaded.get(self.sub_job_id))
            if planned == self.wanted:
                return False
            state._planned[self.sub_job_id] = self.wanted
            return True

    def load(self, engine: Any) -> None:
        """Load the snapshot into ``engine`` (the drain runs alone), unless it is loaded."""
        state, sub = self.weights, self.sub_job_id
        with state._lock:
            if state._loaded.get(sub) == self.wanted:
                return
            state._loaded.pop(sub, None)  # until the load completes, nothing known is loaded
        try:
            self.snapshot.load_into(engine)
        except BaseException:
            with state._lock:
                if state._planned.get(sub) == self.wanted:
                    del state._planned[sub]
            raise
        with state._lock:
            state._loaded[sub] = self.wanted

    def check(self) -> None:
        """A drain that planned on no load: refuse unless its snapshot's weights are loaded."""
        with self.weights._lock:
            loaded = self.weights._loaded.get(self.sub_job_id)
        if loaded != self.wanted:
            raise Conflict(
                f"the weights of snapshot {self.wanted[1]} of {self.wanted[0]} could not be "
                "loaded for this sample (a load before it failed); send it again",
                code="weights_incomplete",
            )
