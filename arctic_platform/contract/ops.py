"""The op table: every op's facts, written once, read by the client, both routers and the Service.

An op is defined here in one place: its :class:`OpName` member, its body model (the pydantic
model its JSON body validates against, unknown keys are errors; with any rule of its own that the
client applies too) and its row in the table. The server runs it with one runner in
``server/ops.py`` and the client sends it from one method in ``client/calls.py``
(``docs/architecture.md``, "Where to add things").

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
  ``operation`` envelope, or not at all: streaming generation);
* ``keeps_engine_state`` (derived from ``retry``): whether a failure of it part-way leaves its
  engine as it was, so that an unexpected one costs the request, not the job.

Nothing here imports torch, FastAPI or the server: the client-only install reads it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator
from pydantic_core import PydanticCustomError

from arctic_platform.contract.bodies import (
    learning_rate_problem,
    load_source_problem,
    prompts_problem,
    ruled_by,
)
from arctic_platform.contract.problems import Problem
from arctic_platform.contract.sampling_params import SamplingParams, sampling_params_problem

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
    TOKENIZE = "tokenize"
    # A job's lifecycle (``contract/job_ops.py``): addressed by a job, not run on a sub-job.
    CREATE_JOB = "create-job"
    GET_JOB = "get-job"
    CANCEL_JOB = "cancel-job"

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

    @property
    def keeps_engine_state(self) -> bool:
        """Whether the op leaves its engine's state as it found it, even when it fails part-way:
        the ops with no lasting effect, and a save (it only reads the engine). What an
        unexpected failure of such an op costs is the request, not the job."""
        return self.retry == "safe" or self.name is OpName.SAVE


# -- the op bodies (in the table's order) ------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepBody(_Body):
    learning_rate: Annotated[float | None, ruled_by(learning_rate_problem)] = None


# A checkpoint's step is an int64, so its folder name (``checkpoint-<step>``) stays a short name.
Step = Annotated[int, Field(ge=0, le=2**63 - 1)]


class SaveBody(_Body):
    checkpoint_id: str | None = None
    checkpoint_type: Literal["resumable", "weights-only"] = "resumable"
    path: str | None = None
    step: Step | None = None
    export_hf: bool = False
    save_total_limit: NonNegativeInt | None = None
    stage_info: dict[str, Any] | None = None


class LoadBody(_Body):
    """On-prem form ``{path, step}`` or Cortex form ``{checkpoint_id, source_job_id?}``."""

    path: str | None = None
    step: Step | None = None
    checkpoint_id: str | None = None
    source_job_id: str | None = None
    target_sub_job_id: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> LoadBody:
        problem = load_source_problem(self.path, self.checkpoint_id)
        if problem is not None:
            raise PydanticCustomError("invalid_value", "{problem}", {"problem": str(problem)})
        return self


def _completions_problem(value: Any) -> Problem | None:
    return None if value is None else prompts_problem(value, name="completions")


Prompts = Annotated[list[str | list[int]], ruled_by(prompts_problem)]


class GenerateBody(_Body):
    prompts: Prompts
    # Kept as sent (the engines read it with SamplingParams.from_request), ruled on here.
    sampling_params: Annotated[
        dict[str, Any] | list[dict[str, Any] | None] | None, ruled_by(sampling_params_problem)
    ] = None
    routing_key: Any = None
    strict: bool = False

    @model_validator(mode="after")
    def _one_entry_per_prompt(self) -> GenerateBody:
        entries, prompts = self.sampling_params, len(self.prompts)
        if isinstance(entries, list) and len(entries) != prompts:
            problem = Problem(
                "sampling_params", f"has {len(entries)} entries for {prompts} prompts (one each)"
            )
            raise PydanticCustomError("invalid_value", "{problem}", {"problem": str(problem)})
        return self

    @property
    def samples(self) -> int:
        """The samples it asks for: ``n`` summed over its prompts (validated)."""
        params = self.sampling_params
        per_prompt = params if isinstance(params, list) else [params] * len(self.prompts)
        return sum(SamplingParams.from_request(p).n for p in per_prompt)


class LogProbsBody(_Body):
    prompts: Prompts
    completions: Annotated[list[str | list[int]] | None, ruled_by(_completions_problem)] = None
    top_k: NonNegativeInt = 1


class WeightSyncBody(_Body):
    source_sub_job_id: str | int | None = None
    target_sub_job_ids: list[str | int] = Field(min_length=1)
    cuda_ipc: bool | None = None
    low_memory: bool | None = None
    weight_format: Literal["vllm", "hf", "lora"] | None = None


class ResetPrefixCacheBody(_Body):
    drain: bool = True
    timeout_s: float = Field(60.0, gt=0.0)
    retry_interval_s: float = Field(0.1, gt=0.0)


class SleepInferenceBody(_Body):
    level: int = Field(1, ge=1, le=2)


class SleepTrainingBody(_Body):
    mode: Literal["all", "non_lp", "lp_params"] = "all"


class EmptyBody(_Body):
    pass


class CancelRequestBody(_Body):
    request_id: str = Field(min_length=1)


class TailLogsBody(_Body):
    cursor: str | int | None = None
    max_lines: int = Field(200, ge=1, le=10_000)


def texts_problem(texts: Any) -> Problem | None:
    """``tokenize``'s texts: a non-empty list of strings (as ``generate``'s prompts). The body
    model and the client (before sending) both rule with it."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        return Problem(
            "texts",
            f"must be a list of strings (wrap a single text in a list), got {type(texts).__name__}",
            wrong_type=True,
        )
    if not texts:
        return Problem("texts", "is empty")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            return Problem(
                f"texts[{i}]", f"must be a string, got {type(text).__name__}", wrong_type=True
            )
    return None


class TokenizeBody(_Body):
    """Texts to token ids with the sampling sub-job's tokenizer (``add_special_tokens``: the
    model's BOS/EOS as the tokenizer adds them; off by default, as prompts are tokenized)."""

    texts: Annotated[list[str], ruled_by(texts_problem)]
    add_special_tokens: bool = False


class OperationBody(_Body):
    """The ``/operation`` envelope (both APIs): an operation type and its payload."""

    operation_type: str = Field(min_length=1)
    sub_job_id: str | int | None = None
    sub_job_type: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)


# -- the table ---------------------------------------------------------------------------------

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
    Op(OpName.STEP, ("training",), StepBody, cortex_route="step"),
    Op(OpName.SAVE, ("training",), SaveBody, cortex_route="save"),
    Op(OpName.LOAD_CHECKPOINT, ("training",), LoadBody, cortex_route="load"),
    Op(
        OpName.GENERATE,
        ("sampling",),
        GenerateBody,
        binary_request=True,
        binary_result=True,
        cortex_route="generate",
        retry="safe",
    ),
    Op(
        OpName.GENERATE_STREAM,
        ("sampling",),
        GenerateBody,
        onprem=False,
        cortex_route="generate-stream",
        retry="safe",
        client_op=False,
    ),
    Op(
        OpName.LOG_PROBS,
        ("log_prob",),
        LogProbsBody,
        binary_result=True,
        cortex_route="log-probs",
        retry="safe",
    ),
    Op(
        OpName.WEIGHT_SYNC,
        ("training",),
        WeightSyncBody,
        operation="queued",
        client_op=False,
    ),
    Op(
        OpName.RESET_PREFIX_CACHE,
        ("sampling", "log_prob"),
        ResetPrefixCacheBody,
        operation="quick",
        client_op=False,
    ),
    Op(
        OpName.SLEEP_INFERENCE,
        ("sampling", "log_prob"),
        SleepInferenceBody,
        operation="quick",
    ),
    Op(OpName.WAKE_INFERENCE, ("sampling", "log_prob"), operation="quick"),
    Op(OpName.SLEEP_TRAINING, ("training",), SleepTrainingBody, operation="quick"),
    Op(OpName.WAKE_TRAINING, ("training",), EmptyBody, operation="quick"),
    Op(OpName.EMPTY_TRAINING_CACHE, ("training",), EmptyBody, operation="quick"),
    Op(
        OpName.CANCEL_REQUEST,
        (),
        CancelRequestBody,
        onprem=False,
        operation="inline",
        client_op=False,
    ),
    Op(OpName.TAIL_LOGS, (), TailLogsBody, onprem=False, operation="inline", client_op=False),
    Op(OpName.TOKENIZE, ("sampling",), TokenizeBody, cortex_route="tokenize", retry="safe"),
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
