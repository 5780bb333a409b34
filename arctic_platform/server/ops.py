"""What each op does on each kind of sub-job, and the response shape it returns.

``prepare_op`` runs on the caller's thread: it validates the body (a 400 names the field) and
returns a runner that the sub-job's queue executes. Responses have one shape on every backend,
built by :mod:`arctic_platform.contract.results` (``generate -> {job_id, results}``, or columns:
:mod:`arctic_platform.contract.generate_columns`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from arctic_platform.contract import ops as contract
from arctic_platform.contract import results
from arctic_platform.contract.bodies import longest_row_problem
from arctic_platform.contract.engine_protocols import (
    AnyEngine,
    LogProbEngineProtocol,
    SamplingEngineProtocol,
    TrainingEngineProtocol,
)
from arctic_platform.contract.ops import OpName, TokenizeBody
from arctic_platform.engine.checkpoint_layout import resolve_checkpoint
from arctic_platform.engine.errors import CheckpointNotFound
from arctic_platform.server.engines import job_checkpoint_folder
from arctic_platform.server.errors import BadRequest, NotFound
from arctic_platform.server.op_bodies import parse, train_envelope, wake_tags


def op_kind(op: str, body: Any = None) -> str:
    """The sub-job type an op runs on when the caller names only the parent job."""
    if op not in contract.OPS or not contract.OPS[op].job_types:
        raise NotFound(f"unknown op {op!r}")
    reference = isinstance(body, dict) and bool(body.get("reference_model"))
    return contract.default_role(op, reference_model=reference)


def prepare_op(service, sub, op: str, body: Any) -> Callable[[], Any]:
    """Validate ``body`` for ``op`` on ``sub`` (its model from the op table) and return the
    runner its registered factory makes (see module doc)."""
    if op not in contract.OPS_BY_ROLE[sub.kind]:
        raise BadRequest(
            f"op {op!r} does not run on a {sub.kind} sub-job ({sub.sub_job_id})",
            code="wrong_job_type",
        )
    model = contract.OPS[op].request
    parsed = body if model is None else parse(model, body, what=op)
    return _HANDLERS[op](service, sub, sub.engine, sub.sub_job_id, parsed)


# op -> its runner factory: ``(service, sub, engine, job_id, body) -> runner``, each registered
# with ``@_runs`` where it is defined (``tests/contract/test_ops.py`` checks every op of the table
# that runs on a sub-job has one).
_Handler = Callable[..., Callable[[], Any]]
_HANDLERS: dict[str, _Handler] = {}


def _runs(op: OpName) -> Callable[[_Handler], _Handler]:
    """Register the decorated function as ``op``'s runner factory."""

    def register(handler: _Handler) -> _Handler:
        _HANDLERS[op] = handler
        return handler

    return register


def check_context(
    engine: AnyEngine | None,
    op: str,
    batch,
    *,
    field: str = "batch.input_ids",
    what: str = "row {row}",
) -> None:
    """A row longer than the engine's model context is a 400 here, on the caller's thread, so
    nothing is queued (the engine refuses it too, for callers that reach it directly); ``field``
    and ``what`` name the row as the caller's API does (``{row}``: its index). An engine
    released meanwhile (None) checks nothing: the op is refused when it is queued."""
    problem = None
    if engine is not None:
        problem = longest_row_problem(batch, engine.max_model_len, field=field, what=what)
    if problem is not None:
        raise BadRequest(f"{op}: {problem.field}: {problem.message}", field=problem.field)


@_runs(OpName.FORWARD_BACKWARD)
def _forward_backward(service, sub, engine: TrainingEngineProtocol, job_id, body):
    batch, meta, processing, _ = train_envelope(
        body, op=OpName.FORWARD_BACKWARD, limits=service.limits
    )
    tokens = service.limits.check_batch(OpName.FORWARD_BACKWARD, batch)
    check_context(engine, OpName.FORWARD_BACKWARD, batch)

    def run():
        out = engine.forward_backward(batch, meta, processing)
        service.metrics.add_tokens(OpName.FORWARD_BACKWARD, tokens)
        return results.fwd_bwd_result(job_id, out)

    return run


@_runs(OpName.FORWARD)
def _forward(service, sub, engine: TrainingEngineProtocol | LogProbEngineProtocol, job_id, body):
    batch, meta, processing, _ = train_envelope(body, op=OpName.FORWARD, limits=service.limits)
    tokens = service.limits.check_batch(OpName.FORWARD, batch)
    check_context(engine, OpName.FORWARD, batch)

    def run():
        out = engine.forward(batch, meta, processing)
        service.metrics.add_tokens(OpName.FORWARD, tokens)
        return results.forward_result(job_id, out)

    return run


@_runs(OpName.STEP)
def _step(service, sub, engine: TrainingEngineProtocol, job_id, body):

    def run():
        return results.step_result(job_id, engine.step(body.learning_rate))

    return run


@_runs(OpName.SAVE)
def _save(service, sub, engine: TrainingEngineProtocol, job_id, body):
    owner = service.owner_of(sub.job_id)
    path = None
    if body.path is not None:
        path = service.paths.writable(owner, body.path, field="save.path")

    def run():
        service.checkpoints.check_room(sub)
        # Where it writes, resolved now (links followed): the job's own folder too, and a path
        # checked at submit whose folder became a link out of the space while the op queued.
        # (A link planted as the step's folder is itself replaced: checkpoint_staging.publish.)
        target = job_checkpoint_folder(service, sub) if path is None else path
        service.paths.writable(owner, str(target), field="save.path")
        saved = engine.save_checkpoint(
            path,
            step=body.step,
            export_hf=body.export_hf or body.checkpoint_type == "weights-only",
            save_total_limit=body.save_total_limit,
        )
        service.record_checkpoint(sub, saved, body.checkpoint_type, None)
        # Paths as the owner names them back to load (relative to their space on a shared server).
        shown = service.paths.shown(owner, saved["path"])
        hf_path = saved.get("hf_path")
        return {
            "job_id": job_id,
            "path": shown,
            "hf_path": None if hf_path is None else service.paths.shown(owner, hf_path),
            "global_step": saved["global_step"],
            "checkpoint_id": saved["checkpoint_id"],
            "checkpoint_path": shown,
            "checkpoint_tag": saved["checkpoint_id"],
        }

    return run


@_runs(OpName.LOAD_CHECKPOINT)
def _load(service, sub, engine: TrainingEngineProtocol, job_id, body):
    owner = service.owner_of(sub.job_id)
    path = None
    if body.path is not None:
        path = service.paths.readable(owner, body.path, field="load.path")
    if body.checkpoint_id is not None:  # not both: LoadBody's rule
        source_job = body.source_job_id or sub.job_id
        record = service.checkpoint(source_job, body.checkpoint_id, owner=owner)
        path = service.paths.readable(owner, record["path"], field="load.checkpoint_id")
    if body.target_sub_job_id not in (None, job_id):
        raise BadRequest(f"load: target_sub_job_id {body.target_sub_job_id} is not {job_id}")

    def run():
        # What it reads, resolved now (links followed): the job's own folder too, and the
        # checkpoint folder that ``step`` or ``latest`` picks in it.
        base = job_checkpoint_folder(service, sub) if path is None else path
        service.paths.readable(owner, str(base), field="load.path")
        with contextlib.suppress(CheckpointNotFound):  # the engine says what is missing
            picked = resolve_checkpoint(base, body.step)
            service.paths.readable(owner, str(picked), field="load.path")
        out = engine.load_checkpoint(path, step=body.step)
        return {"job_id": job_id, **out, "path": service.paths.shown(owner, out["path"])}

    return run


@_runs(OpName.SLEEP_TRAINING)
def _sleep_training(service, sub, engine, job_id, body):
    return lambda: {"job_id": job_id, "workers": [engine.sleep(body.mode)]}


@_runs(OpName.WAKE_TRAINING)
def _wake_training(service, sub, engine, job_id, body):
    return lambda: {"job_id": job_id, "workers": [engine.wake()]}


@_runs(OpName.EMPTY_TRAINING_CACHE)
def _empty_training_cache(service, sub, engine, job_id, body):
    return lambda: {"job_id": job_id, "workers": [engine.empty_cache()]}


@_runs(OpName.WEIGHT_SYNC)
def _weight_sync(service, sub, engine: TrainingEngineProtocol, job_id, body):
    if body.source_sub_job_id not in (None, job_id):
        raise BadRequest(
            f"weight-sync: source_sub_job_id {body.source_sub_job_id} is not this training "
            f"sub-job ({job_id})"
        )
    if body.weight_format not in (None, "vllm", "hf"):
        raise BadRequest("weight-sync: weight_format 'lora' is not supported; weights are merged")
    owner = service.owner_of(sub.job_id)
    targets = []
    for target_id in body.target_sub_job_ids:
        target = service.resolve(str(target_id), owner=owner)
        if target.kind == "training":
            raise BadRequest(f"weight-sync: target {target_id} is a training sub-job")
        targets.append(target)

    def run():
        synced = []
        for target in targets:
            service.require_running(target)
            # on the target's queue: the trainer writes into the sampler it names
            result = service.run_on(target, engine.sync_weights_to, target.engine)
            synced.append({"sub_job_id": target.sub_job_id, **result})
        return {"job_id": job_id, "status": "ok", "targets": synced}

    return run


@_runs(OpName.GENERATE)
def _generate(service, sub, engine: SamplingEngineProtocol, job_id, body):
    check_generate(service, engine, OpName.GENERATE, body.prompts, body.sampling_params)

    def run():
        samples = engine.generate(body.prompts, body.sampling_params)
        service.metrics.add_tokens(OpName.GENERATE, sum(len(r["token_ids"]) for r in samples))
        return {"job_id": job_id, "results": samples}

    return run


@_runs(OpName.GENERATE_STREAM)
def _generate_stream(service, sub, engine: SamplingEngineProtocol, job_id, body):
    check_generate(service, engine, OpName.GENERATE_STREAM, body.prompts, body.sampling_params)
    return lambda: engine.generate(body.prompts, body.sampling_params)


def check_generate(
    service, engine: SamplingEngineProtocol | None, op: str, prompts: list, sampling_params: Any
) -> None:
    """The work limits of a generate on ``engine``, for every API that samples (on-prem
    ``generate``, Tinker ``asample``). Without max_tokens a sample may run to the end of the
    engine's context; an engine not loaded yet (None) counts one token, a lower bound."""
    context = 1 if engine is None else engine.max_model_len
    service.limits.check_generate(op, prompts, sampling_params, context)


@_runs(OpName.LOG_PROBS)
def _log_probs(service, sub, engine: LogProbEngineProtocol, job_id, body):
    service.limits.check_rows(OpName.LOG_PROBS, len(body.prompts))

    def run():
        scored = engine.log_probs(body.prompts, body.completions, body.top_k)
        return {"job_id": job_id, "results": scored}

    return run


@_runs(OpName.SLEEP_INFERENCE)
def _sleep_inference(service, sub, engine, job_id, body):
    if sub.kind == "log_prob":
        return lambda: {"job_id": job_id, sub.kind: _not_applicable("sleep")}
    return lambda: {"job_id": job_id, sub.kind: engine.sleep(body.level)}


@_runs(OpName.WAKE_INFERENCE)
def _wake_inference(service, sub, engine, job_id, body):
    tags = wake_tags(body)
    if sub.kind == "log_prob":
        return lambda: {"job_id": job_id, sub.kind: _not_applicable("wake")}
    return lambda: {"job_id": job_id, sub.kind: engine.wake(tags)}


@_runs(OpName.RESET_PREFIX_CACHE)
def _reset_prefix_cache(service, sub, engine, job_id, body):
    if sub.kind == "log_prob":
        return lambda: {"job_id": job_id, sub.kind: _not_applicable("prefix cache")}
    return lambda: {"job_id": job_id, sub.kind: engine.reset_prefix_cache()}


def _not_applicable(what: str) -> dict:
    return {"status": "not_applicable", "reason": f"the log-prob engine keeps no {what} state"}


@_runs(OpName.TOKENIZE)
def _tokenize(service, sub, engine: SamplingEngineProtocol, job_id, body: TokenizeBody):
    # Each text's UTF-8 bytes bound its tokens (a byte-level or character tokenizer emits at most
    # one per byte, before specials), so the batch limits bound the ids this answer carries.
    longest = max(len(text.encode()) for text in body.texts)
    service.limits.check_batch_shape(OpName.TOKENIZE, len(body.texts), longest)
    if engine is not None and engine.tokenizer is None:
        raise BadRequest(
            f"tokenize: sub-job {job_id} holds no tokenizer in this server: its model lives in "
            "a Ray actor (serve --ray); tokenize with the model's own tokenizer instead",
            code="unsupported_op",
        )

    def run():
        encoded = engine.tokenizer(body.texts, add_special_tokens=body.add_special_tokens)
        return {"job_id": job_id, "token_ids": [list(ids) for ids in encoded["input_ids"]]}

    return run
