"""What the Tinker API keeps beside the Service: sessions, training runs, samplers, op order.

* A **session** (``create_session``) belongs to the caller's owner id; the SDK heartbeats it every
  10 s and finishes it (``/sessions/{id}/finish``) when the script ends, which cancels the Service
  jobs it created so their engines are freed. A finished session answers 410, as the SDK expects,
  and so does one lost in a server restart (its id is remembered in the metadata store).
* A **training run** (Tinker's model id ``<session>:train:<n>``) is one Service job with a LoRA
  training sub-job and a sampling sub-job on the same base model.
  ``save_weights_and_get_sampling_client`` takes a **snapshot** of the trainer's weights (its
  engine's ``weight_snapshot``: in this process, small copies of the LoRA adapters; on Ray, the
  merged weights' chunks in the object store); the run keeps the latest :data:`MAX_SNAPSHOTS`,
  and its sampling sub-job loads a snapshot's weights before it samples for it. So a sampling
  client keeps sampling the weights it was created with after the trainer moved on and saved
  again, as Tinker's are (a sampler whose snapshot was dropped is
  refused with 409 rather than answered from other weights).
* A **sampler** (``sampling_session_id``) names the sampling sub-job a ``SamplingClient`` uses: a
  run's own with one of its snapshots, or the owner's job on a base model or a saved
  ``sampler_weights`` checkpoint (:mod:`.model_samplers`: shared, and released when the owner has
  used others more recently).
* :class:`Sequencer` starts a training client's requests in ``seq_id`` order whatever order they
  arrive in (the SDK sends the chunks of one ``forward_backward`` concurrently), and maps a
  retried ``seq_id`` to the request id it already has.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arctic_platform.server.errors import BadRequest, Conflict, NotFound, ServiceError
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.store import MetadataStore

# Adapter snapshots a training run keeps for its sampling clients (the newest ones).
MAX_SNAPSHOTS = 8
# Sampling clients a tenant keeps, the most recently used (the cookbook makes one per step and
# never uses the older ones again): one past it drops the least recently used.
MAX_SAMPLERS_PER_TENANT = 1024
# How far a training run's ``seq_id``s may run ahead of the next one to start, and how far back
# a retried one is still recognised: each parked or remembered one is held in memory.
SEQ_ID_WINDOW = 10_000


class SessionGone(ServiceError):
    """The session was finished (410: the SDK stops heartbeating it)."""

    status = 410
    code = "session_finished"


@dataclass
class Session:
    session_id: str
    owner: str | None
    last_heartbeat: float = field(default_factory=time.time)
    finished: bool = False
    job_ids: list[str] = field(default_factory=list)

    def hold(self, job_id: str, cancel: Callable[[str], None]) -> None:
        """Count ``job_id`` among the jobs finishing the session cancels. A session finished
        while the job was being created cancels it here (``cancel``) and answers 410: the
        finish, which sets ``finished`` before it reads ``job_ids``, may not have seen it."""
        self.job_ids.append(job_id)
        if self.finished:
            cancel(job_id)
            raise SessionGone(f"session {self.session_id} was finished")


# The request id a refused request's ``seq_id`` is remembered with (no request has it).
_REFUSED = ""
# A training client's first seq_id (the SDK sends request_id + 1: tinker/proto/request_conv.py).
FIRST_SEQ_ID = 1


class Sequencer:
    """Starts requests numbered 1, 2, 3, ... in that order (see module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = FIRST_SEQ_ID
        self._parked: dict[int, Callable[[], None]] = {}
        self._request_ids: dict[int, str] = {}

    def known(self, seq_id: int) -> str | None:
        """The request id already given to ``seq_id`` (a retried request), if any. A ``seq_id``
        whose request was refused (:meth:`skip`) has none: reusing it is a 400 naming it (not a
        409, which the SDK retries), as a refusal is final and a new request needs a ``seq_id``
        of its own."""
        with self._lock:
            request_id = self._request_ids.get(seq_id)
        if request_id == _REFUSED:
            raise BadRequest(
                f"seq_id: {seq_id} was used by a request this server refused; send a new "
                "request with the next seq_id",
                field="seq_id",
            )
        return request_id

    def admit(self, seq_id: int, request_id: str, start: Callable[[], None]) -> None:
        """Run ``start`` once every lower ``seq_id`` has started. ``start`` must not raise (it
        reports failures through its future) and should be quick: it runs under the lock, which
        is what keeps starts in order."""
        with self._lock:
            if seq_id < self._next or seq_id in self._parked:
                raise Conflict(f"seq_id {seq_id} was already used by this training client")
            self._check_window(seq_id)
            self._request_ids[seq_id] = request_id
            self._parked[seq_id] = start
            while self._next in self._parked:
                self._parked.pop(self._next)()
                self._next += 1
            self._forget_old()

    def check_window(self, seq_id: int) -> None:
        """400 naming ``seq_id`` when it is :data:`SEQ_ID_WINDOW` or more ahead of the next."""
        with self._lock:
            self._check_window(seq_id)

    def _check_window(self, seq_id: int) -> None:
        if seq_id >= self._next + SEQ_ID_WINDOW:
            raise BadRequest(
                f"seq_id: {seq_id} is {SEQ_ID_WINDOW} or more ahead of this training client's "
                f"next, {self._next}",
                field="seq_id",
            )

    def _forget_old(self) -> None:
        """Forget the request ids of ``seq_id``s more than the window behind the next (mostly
        in ``seq_id`` order, so from the front)."""
        while self._request_ids and next(iter(self._request_ids)) < self._next - SEQ_ID_WINDOW:
            del self._request_ids[next(iter(self._request_ids))]

    @property
    def parked(self) -> bool:
        """Whether a request waits for an earlier ``seq_id``."""
        with self._lock:
            return bool(self._parked)

    def flush(self) -> None:
        """Start every parked request now, in ``seq_id`` order over the gaps: for a run whose
        job has ended, so each fails with the job's error instead of waiting for a ``seq_id``
        that will never come (holding its body, and its bytes among the owner's unfinished
        ops)."""
        with self._lock:
            for seq_id in sorted(self._parked):
                self._parked.pop(seq_id)()
                self._next = seq_id + 1
            self._forget_old()

    def skip(self, seq_id: int) -> None:
        """Mark ``seq_id`` used without running anything (its request was refused; one used
        already or beyond the window is left as it is)."""
        with contextlib.suppress(Conflict, BadRequest):
            self.admit(seq_id, _REFUSED, lambda: None)


@dataclass
class TrainingRun:
    """A Tinker training client's run (see module doc)."""

    model_id: str
    owner: str | None
    session_id: str
    base_model: str
    lora_rank: int
    job_id: str
    sequencer: Sequencer = field(default_factory=Sequencer)
    last_request_time: float = field(default_factory=time.time)
    _snapshots: OrderedDict[int, Any] = field(default_factory=OrderedDict)
    _snapshot_count: int = 0
    _snapshot_lock: threading.Lock = field(default_factory=threading.Lock)

    def add_snapshot(self, adapters: Any) -> int:
        """Keep ``adapters`` as the run's newest snapshot; returns its number."""
        with self._snapshot_lock:
            self._snapshot_count += 1
            self._snapshots[self._snapshot_count] = adapters
            while len(self._snapshots) > MAX_SNAPSHOTS:
                self._snapshots.popitem(last=False)
            return self._snapshot_count

    def drop_snapshots(self) -> None:
        """Release the snapshots (the run's session ended)."""
        with self._snapshot_lock:
            self._snapshots.clear()

    def snapshot(self, number: int) -> Any:
        """The adapters of snapshot ``number``; 409 once newer ones have replaced it."""
        with self._snapshot_lock:
            adapters = self._snapshots.get(number)
        if adapters is None:
            raise Conflict(
                f"sampler weights snapshot {number} of {self.model_id} was dropped (a run keeps "
                f"its latest {MAX_SNAPSHOTS}, none after its session ended); create a new "
                "sampling client"
            )
        return adapters

    @property
    def training_sub_job(self) -> str:
        return f"{self.job_id}:training:0"

    @property
    def sampling_sub_job(self) -> str:
        return f"{self.job_id}:sampling:0"


@dataclass(frozen=True)
class Sampler:
    """A ``SamplingClient``: a run's own sampling sub-job (``sub_job_id``, with a ``snapshot``
    of the run's adapters when taken), or the owner's shared, releasable sampling job on
    ``model`` (a base model or checkpoint folder, :mod:`.model_samplers`), started for
    ``session_id``."""

    sampler_id: str
    owner: str | None
    session_id: str
    base_model: str
    sub_job_id: str | None = None
    model: str | None = None
    model_path: str | None = None
    # (training run model id, snapshot number) for a run's sampler; None: the job's own weights
    snapshot: tuple[str, int] | None = None


class TinkerState:
    """Registries of sessions, runs and samplers; thread-safe; owner-scoped lookups.

    Every session id issued is written to ``records`` (the server's metadata store) too, so that
    after a restart, which loses the sessions and their jobs, a client that heartbeats a lost
    session hears that it ended (410, as for a finished one) and stops, rather than 404.
    Remembering the ids is simpler than recognising them (a signature would need a key that
    outlives the process, and would vouch for ids of any other server holding it). For the same
    reason a finished session leaves memory (:meth:`forget`): its record answers for it, so a
    tenant opening and finishing sessions in a loop does not grow the server's memory (training
    runs are kept: each built an engine).
    """

    def __init__(self, records: MetadataStore) -> None:
        self._lock = threading.Lock()
        self._records = records
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, TrainingRun] = {}
        self._samplers: dict[str | None, OrderedDict[str, Sampler]] = {}  # by owner

    def new_session(self, owner: str | None, limits: ServerLimits) -> Session:
        """A new session of ``owner``'s; 429 beyond its ``max_tinker_sessions_per_tenant`` open
        at once."""
        session = Session(session_id=uuid.uuid4().hex, owner=owner)
        with self._lock:
            open_ = sum(1 for s in self.sessions.values() if s.owner == owner and not s.finished)
            limits.check_tinker_sessions(open_ + 1)
            self.sessions[session.session_id] = session
        self._records.put_tinker_session(session.session_id, owner, session.last_heartbeat)
        return session

    def forget(self, session: Session) -> None:
        """Drop a finished session from memory (its record still answers for it)."""
        assert session.finished
        with self._lock:
            self.sessions.pop(session.session_id, None)

    def all_runs(self) -> list[TrainingRun]:
        with self._lock:
            return list(self.runs.values())

    def active_sessions(self) -> list[Session]:
        with self._lock:
            return [s for s in self.sessions.values() if not s.finished]

    def runs_of(self, session_id: str) -> list[TrainingRun]:
        with self._lock:
            return [r for r in self.runs.values() if r.session_id == session_id]

    def session(self, session_id: str, owner: str | None, *, active: bool = True) -> Session:
        """The caller's session; 404 if unknown, 410 if finished (when ``active``)."""
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            session = self._finished_from_record(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"session {session_id!r} not found")
        if active and session.finished:
            raise SessionGone(f"session {session_id} was finished")
        return session

    def _finished_from_record(self, session_id: str) -> Session | None:
        """A finished session this server issued (in an earlier run, whose end ended its jobs,
        or in this one: :meth:`forget`), from its record; None for an id it never issued."""
        record = self._records.tinker_session(session_id)
        if record is None:
            return None
        return Session(session_id, record["owner"], record["created_at"], finished=True)

    def check_new_run(self, model_id: str) -> None:
        """409 when ``model_id`` is taken: checked before a job is made for it (a client's
        repeated ``create_model``), and again by :meth:`add_run`."""
        with self._lock:
            self._check_new_run(model_id)

    def _check_new_run(self, model_id: str) -> None:
        if model_id in self.runs:
            raise Conflict(f"model {model_id} already exists in this session")

    def add_run(self, run: TrainingRun) -> None:
        with self._lock:
            self._check_new_run(run.model_id)
            self.runs[run.model_id] = run

    def run(self, model_id: str, owner: str | None) -> TrainingRun:
        with self._lock:
            run = self.runs.get(model_id)
        if run is None or run.owner != owner:
            raise NotFound(f"model_id {model_id!r} not found")
        return run

    def add_sampler(self, sampler: Sampler) -> Sampler:
        """Keep ``sampler``, dropping its owner's least recently used one past
        :data:`MAX_SAMPLERS_PER_TENANT`."""
        with self._lock:
            owned = self._samplers.setdefault(sampler.owner, OrderedDict())
            owned[sampler.sampler_id] = sampler
            while len(owned) > MAX_SAMPLERS_PER_TENANT:
                owned.popitem(last=False)
        return sampler

    def sampler(self, sampler_id: str, owner: str | None) -> Sampler:
        """The caller's sampler, made its most recently used; 404 if unknown or dropped."""
        with self._lock:
            owned = self._samplers.get(owner, OrderedDict())
            sampler = owned.get(sampler_id)
            if sampler is not None:
                owned.move_to_end(sampler_id)
        if sampler is None:
            raise NotFound(
                f"sampling_session_id {sampler_id!r} not found (a tenant keeps its "
                f"{MAX_SAMPLERS_PER_TENANT} most recently used sampling clients)"
            )
        return sampler
