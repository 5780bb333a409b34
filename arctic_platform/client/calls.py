"""What each client op sends, and how its answer is shaped: shared by the sync and async clients.

An op becomes a :class:`Call`: the requests to deliver in order (one, or four for
``sync_weights``) and a function that shapes their results. The two client classes only differ
in how they deliver requests, so argument checking, legacy-argument folding and response shapes
cannot drift between them.

Arguments are checked here, before anything is sent: a wrong type or an unknown key is a
``TypeError``/``ValueError`` naming the argument. Responses get the compatibility aliases
frameworks read (:mod:`arctic_platform.contract.results`): ``loss`` and ``avg_loss`` both present;
``grad_norm`` and ``last_lr`` at the top level and in ``metrics``; ``batch`` and ``model_outputs``
naming the same outputs; ``generate`` returns the list of results with tensors as Python lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from arctic_platform.client.config import ArcticRLClientConfig, did_you_mean
from arctic_platform.client.errors import ArcticRLError
from arctic_platform.client.tensors import is_tensor, to_python
from arctic_platform.client.transport import JobHandles, Request
from arctic_platform.contract.bodies import (
    SNOWAPI_ENVELOPE_KEYS,
    TRAIN_ENVELOPE_KEYS,
    learning_rate_problem,
    load_source_problem,
    prompts_problem,
)
from arctic_platform.contract.generate_columns import COLUMNS_KEY, request_columns, results_of
from arctic_platform.contract.ops import OpName, default_role
from arctic_platform.contract.problems import Problem
from arctic_platform.contract.results import shape_step_result, shape_train_result

SYNCHRONOUS_SAVES = {
    "pending_saves": 0,
    "finalized": 0,
    "reason": "save_checkpoint returns after the checkpoint is written; nothing is pending",
}


@dataclass(frozen=True)
class Call:
    """The requests of one client op and how to turn their results into its answer."""

    requests: list[Request]
    shape: Callable[[list[Any]], Any]


def _only(shape: Callable[[Any], Any]) -> Callable[[list[Any]], Any]:
    return lambda results: shape(results[0])


class OpCalls:
    """Builds the :class:`Call` of every op for a client's jobs and config."""

    def __init__(self, jobs: JobHandles, config: ArcticRLClientConfig) -> None:
        self.jobs = jobs
        self.config = config

    # -- training ---------------------------------------------------------------------------

    def fwd_bwd(
        self,
        batch: Mapping,
        processing: Mapping | None,
        router_replay: Any,
        meta: Mapping | None,
        loss_fn: str | None,
        loss_fn_config: Mapping | None,
    ) -> Call:
        body = train_body("fwd_bwd", batch, meta=meta, processing=processing)
        if loss_fn is not None or loss_fn_config is not None:
            folded = dict(body.get("processing") or {})
            if loss_fn is not None:
                folded["loss_fn"] = _str("fwd_bwd", "loss_fn", loss_fn)
            if loss_fn_config is not None:
                config = _mapping("fwd_bwd", "loss_fn_config", loss_fn_config)
                folded["config"] = {**(folded.get("config") or {}), **config}
            body["processing"] = folded
        if router_replay is not None:
            body["router_replay"] = router_replay
        request = self._request(OpName.FORWARD_BACKWARD, body)
        return Call([request], _only(shape_train_result))

    def fwd_no_grad(
        self,
        batch: Mapping,
        reference_model: bool,
        processing: Mapping | None,
        meta: Mapping | None,
    ) -> Call:
        if not isinstance(reference_model, bool):
            raise TypeError(
                f"fwd_no_grad: reference_model must be True or False, got {reference_model!r}"
            )
        body = train_body("fwd_no_grad", batch, meta=meta, processing=processing)
        body["reference_model"] = reference_model
        request = self._request(OpName.FORWARD, body, reference_model=reference_model)
        return Call([request], _only(shape_train_result))

    def step(self, learning_rate: float | None) -> Call:
        body = {}
        if learning_rate is not None:
            _raise("step", learning_rate_problem(learning_rate))
            body["learning_rate"] = float(learning_rate)
        request = self._request(OpName.STEP, body)
        return Call([request], _only(shape_step_result))

    def save_checkpoint(
        self,
        checkpoint_id: str | None,
        checkpoint_type: str,
        path: str | None,
        step: int | None,
        export_hf: bool,
        save_total_limit: int | None,
        stage_info: Mapping | None,
    ) -> Call:
        if path is None and self.config.training is not None:
            path = self.config.training.checkpoint_dir
        body: dict[str, Any] = {"checkpoint_type": checkpoint_type, "export_hf": export_hf}
        optional = {
            "checkpoint_id": checkpoint_id,
            "path": None if path is None else str(path),
            "step": step,
            "save_total_limit": save_total_limit,
            "stage_info": stage_info,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        request = self._request(OpName.SAVE, body)
        return Call([request], _only(dict))

    def load_checkpoint(
        self,
        path: str | None,
        step: int | None,
        checkpoint_id: str | None,
        source_job_id: str | None,
    ) -> Call:
        _raise("load_checkpoint", load_source_problem(path, checkpoint_id))
        if path is None and checkpoint_id is None and self.config.training is not None:
            path = self.config.training.checkpoint_dir
        optional = {
            "path": None if path is None else str(path),
            "step": step,
            "checkpoint_id": checkpoint_id,
            "source_job_id": source_job_id,
        }
        body = {k: v for k, v in optional.items() if v is not None}
        request = self._request(OpName.LOAD_CHECKPOINT, body)
        return Call([request], _only(dict))

    def sleep_training(self, mode: str) -> Call:
        body = {"mode": _str("sleep_training", "mode", mode)}
        return self._simple(OpName.SLEEP_TRAINING, body)

    def wake_training(self) -> Call:
        return self._simple(OpName.WAKE_TRAINING, {})

    def empty_training_cache(self) -> Call:
        return self._simple(OpName.EMPTY_TRAINING_CACHE, {})

    # -- inference --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence | None,
        sampling_params: Mapping | Sequence | None,
        routing_key: Any,
        strict: bool,
        prompt_ids: Sequence | None,
    ) -> Call:
        if prompt_ids is not None:
            if prompts is not None:
                raise TypeError("generate: give prompts or prompt_ids, not both")
            prompts = _prompt_ids(prompt_ids)
        if prompts is None:
            raise TypeError("generate: prompts is required")
        body: dict[str, Any] = {"prompts": prompt_list("generate", prompts)}
        if sampling_params is not None:
            body["sampling_params"] = _sampling_params(sampling_params)
        if routing_key is not None:
            body["routing_key"] = routing_key
        if not isinstance(strict, bool):
            raise TypeError(f"generate: strict must be True or False, got {strict!r}")
        body["strict"] = strict
        request = self._request(OpName.GENERATE, body, frame_metadata=request_columns())
        return Call([request], _only(shape_generate_result))

    def log_probs(self, prompts: Sequence, completions: Sequence | None, top_k: int) -> Call:
        body: dict[str, Any] = {"prompts": prompt_list("log_probs", prompts)}
        if completions is not None:
            body["completions"] = prompt_list("log_probs", completions, name="completions")
            if len(body["completions"]) != len(body["prompts"]):
                raise ValueError(
                    f"log_probs: completions: {len(body['completions'])} completions for "
                    f"{len(body['prompts'])} prompts"
                )
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"log_probs: top_k must be an integer >= 0, got {top_k!r}")
        body["top_k"] = top_k
        request = self._request(OpName.LOG_PROBS, body)
        return Call([request], _only(to_python))

    def sync_weights(self, cuda_ipc: bool | None, low_memory: bool | None) -> Call:
        training = self.jobs.require("training")
        sampling = self.jobs.require("sampling")
        payload: dict[str, Any] = {"source_sub_job_id": training, "target_sub_job_ids": [sampling]}
        for name, value in (("cuda_ipc", cuda_ipc), ("low_memory", low_memory)):
            if value is not None:
                if not isinstance(value, bool):
                    raise TypeError(f"sync_weights: {name} must be True, False or None")
                payload[name] = value
        envelope = {
            "operation_type": OpName.WEIGHT_SYNC,
            "sub_job_id": training,
            "sub_job_type": "training",
            "payload": payload,
        }
        requests = [
            Request(OpName.WAKE_INFERENCE, sampling, ["weights"]),
            Request("operation", training, envelope),
            Request(OpName.WAKE_INFERENCE, sampling, ["kv_cache"]),
            self._reset_prefix_cache_request(True, 60.0, 0.1),
        ]
        return Call(requests, lambda results: dict(results[1]))

    def reset_prefix_cache(self, drain: bool, timeout_s: float, retry_interval_s: float) -> Call:
        request = self._reset_prefix_cache_request(drain, timeout_s, retry_interval_s)
        return Call([request], _only(dict))

    def sleep_inference(self, level: int) -> Call:
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep_inference: level must be 1 or 2, got {level!r}")
        return self._simple(OpName.SLEEP_INFERENCE, {"level": level})

    def wake_inference(self, tags: Sequence[str] | None) -> Call:
        if tags is not None:
            if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
                raise TypeError(f"wake_inference: tags must be a list of strings, got {tags!r}")
            tags = list(tags)
        return self._simple(OpName.WAKE_INFERENCE, tags)

    def _reset_prefix_cache_request(
        self, drain: bool, timeout_s: float, retry_interval_s: float
    ) -> Request:
        envelope = {
            "operation_type": OpName.RESET_PREFIX_CACHE,
            "sub_job_type": "sampling",
            "payload": {
                "drain": drain,
                "timeout_s": timeout_s,
                "retry_interval_s": retry_interval_s,
            },
        }
        return Request("operation", self.jobs.require("sampling"), envelope)

    def _request(
        self, op: str, body: Any, *, reference_model: bool = False, frame_metadata=None
    ) -> Request:
        """``op`` for the sub-job the op table runs it on (whether its body is a DSSST1 frame
        comes from the table too)."""
        role = default_role(op, reference_model=reference_model)
        return Request(op, self.jobs.require(role), body, frame_metadata=frame_metadata)

    def _simple(self, op: str, body: Any) -> Call:
        return Call([self._request(op, body)], _only(dict))


# -- bodies -----------------------------------------------------------------------------------


def train_body(
    what: str, batch: Any, *, meta: Mapping | None = None, processing: Mapping | None = None
) -> dict[str, Any]:
    """The ``{batch, meta, processing}`` envelope for ``batch``, checked and with kwargs folded.

    ``batch`` is the envelope frameworks pass (``{"batch": {tensors}, "meta": ..., "processing":
    ...}``, or the SnowAPI ``{"args", "kwargs", ...}`` form), or a bare dict of tensors.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"{what}: batch must be a dict ({{'batch': {{tensors}}, 'meta': {{...}}, "
            f"'processing': {{...}}}} or a dict of tensors), got {type(batch).__name__}"
        )
    if "batch" in batch or "kwargs" in batch:
        allowed = TRAIN_ENVELOPE_KEYS if "batch" in batch else SNOWAPI_ENVELOPE_KEYS
        unknown = [k for k in batch if k not in allowed]
        if unknown:
            raise TypeError(
                f"{what}: unknown envelope key {unknown[0]!r}{did_you_mean(unknown[0], allowed)}; "
                f"allowed: {sorted(allowed)}"
            )
        body = dict(batch)
        tensors_key = "batch" if "batch" in batch else "kwargs"
    else:
        body = {"batch": batch}
        tensors_key = "batch"
    body[tensors_key] = _tensors(what, body[tensors_key], tensors_key)
    for name, extra in (("meta", meta), ("processing", processing)):
        if extra is not None:
            folded = _mapping(what, name, extra)
            existing = body.get(name) or {}
            if not isinstance(existing, Mapping):
                raise TypeError(f"{what}: {name} must be a dict, got {type(existing).__name__}")
            body[name] = {**existing, **folded}
        elif name in body and body[name] is not None and not isinstance(body[name], Mapping):
            raise TypeError(f"{what}: {name} must be a dict, got {type(body[name]).__name__}")
    return body


def _tensors(what: str, tensors: Any, key: str) -> dict[str, Any]:
    if not isinstance(tensors, Mapping) or not tensors:
        raise TypeError(f"{what}: {key} must be a non-empty dict of tensors")
    out = {}
    for name, value in tensors.items():
        if value is None:
            continue
        if not is_tensor(value):
            hint = (
                " (convert it with numpy.asarray(..., dtype=...))"
                if isinstance(value, list)
                else ""
            )
            raise TypeError(
                f"{what}: {key}[{name!r}] must be a numpy array or torch tensor, got "
                f"{type(value).__name__}{hint}"
            )
        out[name] = value
    return out


def prompt_list(what: str, prompts: Any, *, name: str = "prompts") -> list:
    """Prompts as a list of strings or token-id lists (arrays of ids become lists), checked by
    the contract's rule (:func:`arctic_platform.contract.bodies.prompts_problem`)."""
    if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        prompts = [to_python(p) if is_tensor(p) else p for p in prompts]
    _raise(what, prompts_problem(prompts, name=name))
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _raise(what: str, problem: Problem | None) -> None:
    """A contract rule's problem as the Python error a caller expects (TypeError for a value
    of the wrong type, else ValueError)."""
    if problem is not None:
        raise (TypeError if problem.wrong_type else ValueError)(f"{what}: {problem}")


def _prompt_ids(prompt_ids: Any) -> list:
    """The legacy ``prompt_ids=``: one prompt's ids, or a list of them."""
    ids = to_python(prompt_ids) if is_tensor(prompt_ids) else prompt_ids
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(t, int) for t in ids):
        return [list(ids)]
    return ids


def _sampling_params(params: Any) -> Any:
    if isinstance(params, Mapping):
        return dict(params)
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        for i, item in enumerate(params):
            if item is not None and not isinstance(item, Mapping):
                raise TypeError(f"generate: sampling_params[{i}] must be a dict or None")
        return [None if p is None else dict(p) for p in params]
    raise TypeError(
        "generate: sampling_params must be a dict (for every prompt) or a list of dicts "
        f"(one per prompt), got {type(params).__name__}"
    )


def _mapping(what: str, name: str, value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what}: {name} must be a dict, got {type(value).__name__}")
    return dict(value)


def _str(what: str, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what}: {name} must be a string, got {type(value).__name__}")
    return value


# -- responses --------------------------------------------------------------------------------


def shape_generate_result(result: Any) -> list:
    """``generate``: the list of results with Python lists, from either result form (the tensor
    columns this client asks for, or the reference list an older server sends)."""
    try:
        results = results_of(result)
    except ValueError as exc:
        raise ArcticRLError(f"generate: malformed result columns: {exc}") from None
    if results is None:
        raise ArcticRLError(f"generate: the answer has no results list: {str(result)[:200]}")
    if isinstance(result, Mapping) and COLUMNS_KEY in result:
        return results  # unpacked into plain Python values already
    return to_python(results)
