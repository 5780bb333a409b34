"""What each op does on each kind of sub-job, and the response shape it returns.

``prepare_op`` runs on the caller's thread: it validates the body (a 400 names the field) and
returns a runner that the sub-job's queue executes. Responses have one shape on every backend
(DESIGN.md §3): ``forward-backward -> {job_id, avg_loss, loss, metrics}``, ``forward -> {job_id,
batch: {logprobs[, entropy]}, metrics, avg_loss}``, ``step -> {job_id, global_steps, last_lr,
grad_norm, metrics}``, ``generate -> {job_id, results}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from arctic_platform.server import op_bodies as bodies
from arctic_platform.server.errors import BadRequest, NotFound

TRAINING_OPS = {
    "forward-backward",
    "forward",
    "step",
    "save",
    "load-checkpoint",
    "sleep-training",
    "wake-training",
    "empty-training-cache",
    "weight-sync",
}
SAMPLING_OPS = {
    "generate",
    "generate-stream",
    "sleep-inference",
    "wake-inference",
    "reset-prefix-cache",
}
LOG_PROB_OPS = {"forward", "log-probs", "sleep-inference", "wake-inference", "reset-prefix-cache"}
OPS_BY_KIND = {"training": TRAINING_OPS, "sampling": SAMPLING_OPS, "log_prob": LOG_PROB_OPS}
# Ops whose results carry tensors: delivered as DSSST1 by the HTTP routers.
BINARY_RESULTS = {"forward-backward", "forward", "generate", "log-probs"}


def op_kind(op: str, body: Any = None) -> str:
    """The sub-job type an op runs on when the caller names only the parent job."""
    if op == "forward":
        return "log_prob" if isinstance(body, dict) and body.get("reference_model") else "training"
    if op in SAMPLING_OPS:
        return "sampling"
    if op == "log-probs":
        return "log_prob"
    if op in TRAINING_OPS:
        return "training"
    raise NotFound(f"unknown op {op!r}")


def prepare_op(service, sub, op: str, body: Any) -> Callable[[], Any]:
    """Validate ``body`` for ``op`` on ``sub`` and return the runner (see module doc)."""
    if op not in OPS_BY_KIND[sub.kind]:
        raise BadRequest(
            f"op {op!r} does not run on a {sub.kind} sub-job ({sub.sub_job_id})",
            code="wrong_job_type",
        )
    engine = sub.engine
    job_id = sub.sub_job_id
    handler = _HANDLERS[op]
    return handler(service, sub, engine, job_id, body)


def _forward_backward(service, sub, engine, job_id, body):
    batch, meta, processing, _ = bodies.train_envelope(body, op="forward-backward")
    service.limits.check_batch("forward-backward", batch)

    def run():
        out = engine.forward_backward(batch, meta, processing)
        return {
            "job_id": job_id,
            "avg_loss": out["avg_loss"],
            "loss": out["loss"],
            "metrics": out["metrics"],
        }

    return run


def _forward(service, sub, engine, job_id, body):
    batch, meta, processing, _ = bodies.train_envelope(body, op="forward")
    service.limits.check_batch("forward", batch)

    def run():
        out = engine.forward(batch, meta, processing)
        tensors = {k: out[k] for k in ("logprobs", "entropy") if k in out}
        return {
            "job_id": job_id,
            "batch": tensors,
            "metrics": out["metrics"],
            "avg_loss": out.get("avg_loss", 0.0),
        }

    return run


def _step(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.StepBody, body, what="step")

    def run():
        out = engine.step(parsed.learning_rate)
        return {
            "job_id": job_id,
            "global_steps": out["global_steps"],
            "last_lr": out["last_lr"],
            "grad_norm": out["grad_norm"],
            "metrics": out["metrics"],
        }

    return run


def _save(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.SaveBody, body, what="save")
    path = None
    if parsed.path is not None:
        path = service.paths.writable(service.owner_of(sub.job_id), parsed.path, field="save.path")

    def run():
        saved = engine.save_checkpoint(
            path,
            step=parsed.step,
            export_hf=parsed.export_hf or parsed.checkpoint_type == "weights-only",
            save_total_limit=parsed.save_total_limit,
        )
        service.record_checkpoint(sub, saved, parsed.checkpoint_type, None)
        return {
            "job_id": job_id,
            "path": saved["path"],
            "hf_path": saved.get("hf_path"),
            "global_step": saved["global_step"],
            "checkpoint_id": saved["checkpoint_id"],
            "checkpoint_path": saved["path"],
            "checkpoint_tag": saved["checkpoint_id"],
        }

    return run


def _load(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.LoadBody, body, what="load")
    owner = service.owner_of(sub.job_id)
    path = None
    if parsed.path is not None:
        path = service.paths.readable(owner, parsed.path, field="load.path")
    if parsed.checkpoint_id is not None:
        if parsed.path is not None:
            raise BadRequest("load: give either path or checkpoint_id, not both")
        source_job = parsed.source_job_id or sub.job_id
        record = service.checkpoint(source_job, parsed.checkpoint_id, owner=owner)
        path = service.paths.readable(owner, record["path"], field="load.checkpoint_id")
    if parsed.target_sub_job_id not in (None, job_id):
        raise BadRequest(f"load: target_sub_job_id {parsed.target_sub_job_id} is not {job_id}")

    def run():
        out = engine.load_checkpoint(path, step=parsed.step)
        return {"job_id": job_id, **out}

    return run


def _sleep_training(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.SleepTrainingBody, body, what="sleep-training")
    return lambda: {"job_id": job_id, "workers": [engine.sleep(parsed.mode)]}


def _wake_training(service, sub, engine, job_id, body):
    bodies.parse(bodies.EmptyBody, body, what="wake-training")
    return lambda: {"job_id": job_id, "workers": [engine.wake()]}


def _empty_training_cache(service, sub, engine, job_id, body):
    bodies.parse(bodies.EmptyBody, body, what="empty-training-cache")
    return lambda: {"job_id": job_id, "workers": [engine.empty_cache()]}


def _weight_sync(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.WeightSyncBody, body, what="weight-sync")
    if parsed.source_sub_job_id not in (None, job_id):
        raise BadRequest(
            f"weight-sync: source_sub_job_id {parsed.source_sub_job_id} is not this training "
            f"sub-job ({job_id})"
        )
    if parsed.weight_format not in (None, "vllm", "hf"):
        raise BadRequest("weight-sync: weight_format 'lora' is not supported; weights are merged")
    owner = service.owner_of(sub.job_id)
    targets = []
    for target_id in parsed.target_sub_job_ids:
        target = service.resolve(str(target_id), owner=owner)
        if target.kind == "training":
            raise BadRequest(f"weight-sync: target {target_id} is a training sub-job")
        targets.append(target)

    def run():
        from arctic_platform.engine.weights import sync_in_process

        synced = []
        for target in targets:
            service.require_running(target)
            # An engine whose weights live elsewhere (Ray workers) moves them itself.
            remote = getattr(engine, "sync_weights_to", None)
            if remote is not None:
                result = service.run_on(target, remote, target.engine)
            else:
                result = service.run_on(target, sync_in_process, engine.model, target.engine)
            synced.append({"sub_job_id": target.sub_job_id, **result})
        return {"job_id": job_id, "status": "ok", "targets": synced}

    return run


def _generate(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.GenerateBody, body, what="generate")
    _check_generate(service, engine, "generate", parsed)

    def run():
        results = engine.generate(parsed.prompts, parsed.sampling_params)
        return {"job_id": job_id, "results": results}

    return run


def _generate_stream(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.GenerateBody, body, what="generate-stream")
    _check_generate(service, engine, "generate-stream", parsed)
    return lambda: engine.generate(parsed.prompts, parsed.sampling_params)


def _check_generate(service, engine, op: str, parsed) -> None:
    # Without max_tokens a sample may run to the end of the engine's context.
    context = getattr(engine, "max_model_len", 1)
    service.limits.check_generate(op, parsed.prompts, parsed.sampling_params, context)


def _log_probs(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.LogProbsBody, body, what="log-probs")
    service.limits.check_rows("log-probs", len(parsed.prompts))

    def run():
        results = engine.log_probs(parsed.prompts, parsed.completions, parsed.top_k)
        return {"job_id": job_id, "results": results}

    return run


def _sleep_inference(service, sub, engine, job_id, body):
    parsed = bodies.parse(bodies.SleepInferenceBody, body, what="sleep-inference")
    if sub.kind == "log_prob":
        return lambda: {"job_id": job_id, sub.kind: _not_applicable("sleep")}
    return lambda: {"job_id": job_id, sub.kind: engine.sleep(parsed.level)}


def _wake_inference(service, sub, engine, job_id, body):
    tags = bodies.wake_tags(body)
    if sub.kind == "log_prob":
        return lambda: {"job_id": job_id, sub.kind: _not_applicable("wake")}
    return lambda: {"job_id": job_id, sub.kind: engine.wake(tags)}


def _reset_prefix_cache(service, sub, engine, job_id, body):
    bodies.parse(bodies.ResetPrefixCacheBody, body, what="reset-prefix-cache")
    if sub.kind == "log_prob":
        return lambda: {"job_id": job_id, sub.kind: _not_applicable("prefix cache")}
    return lambda: {"job_id": job_id, sub.kind: engine.reset_prefix_cache()}


def _not_applicable(what: str) -> dict:
    return {"status": "not_applicable", "reason": f"the log-prob engine keeps no {what} state"}


_HANDLERS = {
    "forward-backward": _forward_backward,
    "forward": _forward,
    "step": _step,
    "save": _save,
    "load-checkpoint": _load,
    "sleep-training": _sleep_training,
    "wake-training": _wake_training,
    "empty-training-cache": _empty_training_cache,
    "weight-sync": _weight_sync,
    "generate": _generate,
    "generate-stream": _generate_stream,
    "log-probs": _log_probs,
    "sleep-inference": _sleep_inference,
    "wake-inference": _wake_inference,
    "reset-prefix-cache": _reset_prefix_cache,
}
