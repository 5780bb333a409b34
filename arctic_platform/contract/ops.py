"""The op table: every op's facts, written once, read by the client, both routers and the Service.

Each :class:`Op` says what an op is on every side of the wire:

* ``name``: its canonical name (the on-prem route segment, the ``operation_type``, the name the
  Service dispatches on), an :class:`OpName` member: code elsewhere writes ``OpName.STEP``, never
  the string;
* ``job_types``: the sub-job types it runs on; the first is the one chosen when a caller names
  only the parent job (``forward`` with ``reference_model: true`` goes to the log-prob job);
* ``request``: the pydantic model its JSON body validates against (None: a tensor envelope, checked
  by the server's ``train_envelope``, or a free-form body such as ``wake-inference``'s tags);
* ``binary_request`` / ``binary_result``: the body / result travel as DSSST1 frames;
* ``onprem``: whether ``POST /{name}?job_id=`` serves it;
* ``cortex_route``: its route under ``/{job}`` on the Cortex API (None: it travels as an
  ``/operation`` envelope there);
* ``retry``: whether a client may repeat it after a failure that may have reached the server:
  ``"safe"`` (no lasting effect), ``"chunk_group"`` (the server executes each chunk group once, so
  a repeated upload returns the first request), ``"never"`` (a repeat could apply it twice);
* ``operation``: how it travels inside an ``/operation`` envelope: ``"queued"`` (runs on the
  sub-job's queue, polled), ``"quick"`` (answered inline after running on the queue), ``"inline"``
  (answered at once without a queue), or None (not an operation type);
* ``client_op``: whether the client sends it as itself (the others it sends only inside an
  ``operation`` envelope, or not at all: streaming generation).

Nothing here imports torch, FastAPI or the server: the client-only install reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel

from arctic_platform.contract import bodies

Role = Literal["training", "sampling", "log_prob"]
ROLES: tuple[Role, ...] = ("training", "sampling", "log_prob")
Retry = Literal["safe", "chunk_group", "never"]
OperationKind = Literal["queued", "quick", "inline"]


class OpName(StrEnum):
    """Every op's canonical name, written once: code elsewhere names an op as ``OpName.STEP``,
    never as the string. A member is a ``str`` equal to (and hashing as) its value, so tables
    keyed by the plain names still find it, and it formats, JSON-encodes and travels as that
    plain string.
    """

    FORWARD_BACKWARD = "forward-backward"
    FORWARD = "forward"
    STEP = "step"
    SAVE = "save"
    LOAD_CHECKPOINT = "load-checkpoint"
    GENERATE = "generate"
    GENERATE_STREAM = "generate-stream"
    LOG_PROBS = "log-probs"
    WEIGHT_SYNC = "weight-sync"
    RESET_PREFIX_CACHE = "reset-prefix-cache"
    SLEEP_INFERENCE = "sleep-inference"
    WAKE_INFERENCE = "wake-inference"
    SLEEP_TRAINING = "sleep-training"
    WAKE_TRAINING = "wake-training"
    EMPTY_TRAINING_CACHE = "empty-training-cache"
    CANCEL_REQUEST = "cancel-request"
    TAIL_LOGS = "tail-logs"

    def __repr__(self) -> str:
        # Messages show an op with ``!r`` (``op 'step' does not run on ...``) or list the table
        # (``known: sorted(OPS)``): a member reads as its plain string there too.
        return repr(self.value)


@dataclass(frozen=True)
class Op:
    """The facts of one op (see the module doc)."""

    name: OpName
    job_types: tuple[Role, ...]
    request: type[BaseModel] | None = None
    binary_request: bool = False
    binary_result: bool = False
    onprem: bool = True
    cortex_route: str | None = None
    retry: Retry = "never"
    operation: OperationKind | None = None
    client_op: bool = True


_TABLE = (
    Op(
        OpName.FORWARD_BACKWARD,
        ("training",),
        binary_request=True,
        binary_result=True,
        cortex_route="forward-backward",
        retry="chunk_group",
    ),
    Op(
        OpName.FORWARD,
        ("training", "log_prob"),
        binary_request=True,
        binary_result=True,
        cortex_route="forward-no-grad",
        retry="safe",
    ),
    Op(OpName.STEP, ("training",), bodies.StepBody, cortex_route="step"),
    Op(OpName.SAVE, ("training",), bodies.SaveBody, cortex_route="save"),
    Op(OpName.LOAD_CHECKPOINT, ("training",), bodies.LoadBody, cortex_route="load"),
    Op(
        OpName.GENERATE,
        ("sampling",),
        bodies.GenerateBody,
        binary_request=True,
        binary_result=True,
        cortex_route="generate",
        retry="safe",
    ),
    Op(
        OpName.GENERATE_STREAM,
        ("sampling",),
        bodies.GenerateBody,
        onprem=False,
        cortex_route="generate-stream",
        retry="safe",
        client_op=False,
    ),
    Op(
        OpName.LOG_PROBS,
        ("log_prob",),
        bodies.LogProbsBody,
        binary_result=True,
        cortex_route="log-probs",
        retry="safe",
    ),
    Op(
        OpName.WEIGHT_SYNC,
        ("training",),
        bodies.WeightSyncBody,
        operation="queued",
        client_op=False,
    ),
    Op(
        OpName.RESET_PREFIX_CACHE,
        ("sampling", "log_prob"),
        bodies.ResetPrefixCacheBody,
        operation="quick",
        client_op=False,
    ),
    Op(
        OpName.SLEEP_INFERENCE,
        ("sampling", "log_prob"),
        bodies.SleepInferenceBody,
        operation="quick",
    ),
    Op(OpName.WAKE_INFERENCE, ("sampling", "log_prob"), operation="quick"),
    Op(OpName.SLEEP_TRAINING, ("training",), bodies.SleepTrainingBody, operation="quick"),
    Op(OpName.WAKE_TRAINING, ("training",), bodies.EmptyBody, operation="quick"),
    Op(OpName.EMPTY_TRAINING_CACHE, ("training",), bodies.EmptyBody, operation="quick"),
    Op(
        OpName.CANCEL_REQUEST,
        (),
        bodies.CancelRequestBody,
        onprem=False,
        operation="inline",
        client_op=False,
    ),
    Op(
        OpName.TAIL_LOGS, (), bodies.TailLogsBody, onprem=False, operation="inline", client_op=False
    ),
)

OPS: dict[str, Op] = {op.name: op for op in _TABLE}
# The envelope that carries an operation type and its payload (both APIs).
OPERATION = "operation"
OPERATION_TYPES = frozenset(op.name for op in _TABLE if op.operation is not None)
INLINE_OPERATIONS = frozenset(op.name for op in _TABLE if op.operation == "inline")
QUICK_OPERATIONS = frozenset(op.name for op in _TABLE if op.operation == "quick")
ONPREM_OPS = frozenset({OPERATION, *(op.name for op in _TABLE if op.onprem)})
BINARY_RESULTS = frozenset(op.name for op in _TABLE if op.binary_result)
OPS_BY_ROLE: dict[Role, frozenset[str]] = {
    role: frozenset(op.name for op in _TABLE if role in op.job_types) for role in ROLES
}
# The canonical op names a client sends (``arctic_platform.client.OPS``).
CLIENT_OPS = frozenset({OPERATION, *(op.name for op in _TABLE if op.client_op)})


def op(name: str) -> Op:
    """The op called ``name``; ``KeyError`` naming the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {sorted(OPS)}") from None


def default_role(name: str, *, reference_model: bool = False) -> Role:
    """The sub-job type ``name`` runs on when the caller names only the parent job."""
    if name == OpName.FORWARD and reference_model:
        return "log_prob"
    return op(name).job_types[0]


def cortex_op_of_route(route: str) -> Op:
    """The op a Cortex data-plane route serves."""
    for candidate in _TABLE:
        if candidate.cortex_route == route:
            return candidate
    raise KeyError(f"no op has the Cortex route {route!r}")
