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

    def plan(self, sub_job_id: str, wanted: SnapshotId) -> bool:
        """Whether a drain of ``wanted`` being queued now must load (it then becomes the plan).
        Its caller queues the drain before another drain of the sub-job plans."""
        with self._lock:
            planned = self._planned.get(sub_job_id, self._loaded.get(sub_job_id))
            if planned == wanted:
                return False
            self._planned[sub_job_id] = wanted
            return True

    def load(self, sub_job_id: str, wanted: SnapshotId, snapshot: Any, engine: Any) -> None:
        """Load ``snapshot`` into ``engine`` (the drain runs alone), unless it is loaded."""
        with self._lock:
            if self._loaded.get(sub_job_id) == wanted:
                return
            self._loaded.pop(sub_job_id, None)  # until the load completes, nothing is known
        try:
            snapshot.load_into(engine)
        except BaseException:
            with self._lock:
                if self._planned.get(sub_job_id) == wanted:
                    del self._planned[sub_job_id]
            raise
        with self._lock:
            self._loaded[sub_job_id] = wanted

    def check(self, sub_job_id: str, wanted: SnapshotId) -> None:
        """A drain that planned on no load: refuse unless ``wanted``'s weights are loaded."""
        with self._lock:
            loaded = self._loaded.get(sub_job_id)
        if loaded != wanted:
            raise Conflict(
                f"the weights of snapshot {wanted[1]} of {wanted[0]} could not be loaded for "
                "this sample (a load before it failed); send it again",
                code="weights_incomplete",
            )


@dataclass(frozen=True)
class SnapshotLoad:
    """One drain's snapshot, bound for its :class:`SnapshotWeights`: :meth:`plan` as it is
    queued, then :meth:`load` or :meth:`check` at its turn (see module doc)."""

    weights: SnapshotWeights
    sub_job_id: str
    wanted: SnapshotId
    snapshot: Any

    def plan(self) -> bool:
        return self.weights.plan(self.sub_job_id, self.wanted)

    def load(self, engine: Any) -> None:
        self.weights.load(self.sub_job_id, self.wanted, self.snapshot, engine)

    def check(self) -> None:
        self.weights.check(self.sub_job_id, self.wanted)
