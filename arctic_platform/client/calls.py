"""The client's ops, each written once for the sync and the async client, and their shapes.

An op is one :class:`op_method` of :class:`ClientOps`, the base of both clients: it checks its
arguments, and returns a :class:`Call`: the requests to deliver in order (one, or four for
``sync_weights``) and a function that shapes their results. ``SyncArcticRLClient`` runs the Call
and returns the answer, ``ArcticRLClient`` awaits it; they differ only in how they deliver
requests, so argument checking, legacy-argument folding and response shapes cannot drift between
them, and a new op is one method here.

Arguments are checked here, before anything is sent: a wrong type or an unknown key is a
``TypeError``/``ValueError`` naming the argument. Responses get the compatibility aliases
frameworks read (:mod:`arctic_platform.contract.results`): ``loss`` and ``avg_loss`` both present;
``grad_norm`` and ``last_lr`` at the top level and in ``metrics``; ``batch`` and ``model_outputs``
naming the same outputs; ``generate`` returns the list of results with tensors as Python lists.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

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
from arctic_platform.contract.ops import OpName, default_role, texts_problem
from arctic_platform.contract.problems import Problem
from arctic_platform.contract.results import shape_step_result, shape_train_result

if TYPE_CHECKING:
    from arctic_platform.client.client import ArcticRLClient

P = ParamSpec("P")
R = TypeVar("R")
SYNCHRONOUS_SAVES = {
    "pending_saves": 0,
    "finalized": 0,
    "reason": "save_checkpoint returns after the checkpoint is written; nothing is pending",
}


@dataclass(frozen=True)
class Call(Generic[R]):
    """The requests of one client op and how to turn their results into its answer."""

    requests: list[Request]
    shape: Callable[[list[Any]], R]


def _only(shape: Callable[[Any], R]) -> Callable[[list[Any]], R]:
    return lambda results: shape(results[0])


class op_method(Generic[P, R]):
    """An op of both clients, written once as the :class:`Call` it makes.

    The decorated function takes the client and the op's arguments and returns the ``Call``. On
    :class:`~arctic_platform.client.client.SyncArcticRLClient` the method runs it and returns its
    result; on :class:`~arctic_platform.client.client.ArcticRLClient` it is a coroutine function
    that awaits it. Both keep the function's name, docstring and signature (``help()``,
    ``inspect.signature``), and type checkers see ``(args) -> R`` and ``(args) ->
    Coroutine[..., R]`` through the overloads of ``__get__``. A closed client refuses the op
    before its arguments are checked.
    """

    def __init__(self, build: Callable[Concatenate[Any, P], Call[R]]) -> None:
        self._build = build
        self._methods: dict[type, Callable[..., Any]] = {}
        functools.update_wrapper(self, build)

    @overload
    def __get__(self, client: None, owner: type) -> Callable[..., Any]: ...

    @overload
    def __get__(
        self, client: ArcticRLClient, owner: type
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __get__(self, client: ClientOps, owner: type) -> Callable[P, R]: ...

    def __get__(self, client: Any, owner: type) -> Any:
        if not hasattr(owner, "_run"):
            return self  # on ClientOps itself: no client class to run it yet
        method = self._methods.get(owner)
        if method is None:
            method = self._methods[owner] = self._method_for(owner)
        return method if client is None else types.MethodType(method, client)

    def _method_for(self, owner: type) -> Callable[..., Any]:
        """The plain function of ``owner`` (what its instances bind, and what ``help`` shows):
        blocking, or a coroutine function when ``owner._run`` is one."""
        build = self._build
        if inspect.iscoroutinefunction(owner._run):

            async def method(client, *args, **kwargs):
                client._check_open()
                return await client._run(build(client, *args, **kwargs))

        else:

            def method(client, *args, **kwargs):
                client._check_open()
                return client._run(build(client, *args, **kwargs))

        functools.update_wrapper(method, build)
        del method.__wrapped__  # its signature is the op's, with the result in place of the Call
        signature = inspect.signature(build)
        returned = signature.return_annotation
        if isinstance(returned, str) and returned.startswith("Call[") and returned.endswith("]"):
            returned = returned[len("Call[") : -1]
        method.__signature__ = signature.replace(return_annotation=returned)
        return method


class ClientOps:
    """The op surface both clients share: each op is one :class:`op_method` here, which checks
    its arguments (a wrong type or an unknown key is a ``TypeError``/``ValueError`` naming the
    argument, before anything is sent), builds its requests for the sub-job the op table runs it
    on, and says how its results become the answer. ``jobs`` and ``config`` are the client's."""

    jobs: JobHandles
    config: ArcticRLClientConfig
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise ArcticRLError("this client was closed (shut down); create a new one")

    # -- training ---------------------------------------------------------------------------

    @op_method
    def fwd_bwd(
        self,
        batch: Mapping,
        processing: Mapping | None = None,
        router_replay: Any = None,
        *,
        meta: Mapping | None = None,
        loss_fn: str | None = None,
        loss_fn_config: Mapping | None = None,
    ) -> Call[dict]:
        """Accumulate the gradient of the batch's loss: ``{job_id, loss, avg_loss, metrics}``."""
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

    @op_method
    def fwd_no_grad(
        self,
        batch: Mapping,
        reference_model: bool = False,
        *,
        processing: Mapping | None = None,
        meta: Mapping | None = None,
    ) -> Call[dict]:
        """Log-probs without gradients (the reference model with ``reference_model=True``)."""
        if not isinstance(reference_model, bool):
            raise TypeError(
                f"fwd_no_grad: reference_model must be True or False, got {reference_model!r}"
            )
        body = train_body("fwd_no_grad", batch, meta=meta, processing=processing)
        body["reference_model"] = reference_model
        request = self._request(OpName.FORWARD, body, reference_model=reference_model)
        return Call([request], _only(shape_train_result))

    @op_method
    def step(self, learning_rate: float | None = None) -> Call[dict]:
        """Apply the accumulated gradients: ``{job_id, global_steps, last_lr, grad_norm, ...}``."""
        body = {}
        if learning_rate is not None:
            _raise("step", learning_rate_problem(learning_rate))
            body["learning_rate"] = float(learning_rate)
        request = self._request(OpName.STEP, body)
        return Call([request], _only(shape_step_result))

    @op_method
    def save_checkpoint(
        self,
        checkpoint_id: str | None = None,
        checkpoint_type: str = "resumable",
        path: str | None = None,
        *,
        step: int | None = None,
        export_hf: bool = False,
        save_total_limit: int | None = None,
        stage_info: Mapping | None = None,
    ) -> Call[dict]:
        """Save weights, optimizer and schedule: ``{path, checkpoint_id, global_step, hf_path}``."""
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

    @op_method
    def load_checkpoint(
        self,
        path: str | None = None,
        *,
        step: int | None = None,
        checkpoint_id: str | None = None,
        source_job_id: str | None = None,
    ) -> Call[dict]:
        """Restore a checkpoint by folder (``path``, ``step``) or by ``checkpoint_id``."""
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

    @op_method
    def finalize_pending_saves(self) -> Call[dict]:
        """Saves are synchronous here, so nothing is ever pending; says so (sends nothing)."""
        return Call([], lambda results: dict(SYNCHRONOUS_SAVES))

    @op_method
    def sleep_training(self, mode: str = "all") -> Call[dict]:
        """Offload the trainer's state (``mode``: ``all``, ``non_lp`` or ``lp_params``)."""
        body = {"mode": _str("sleep_training", "mode", mode)}
        return self._simple(OpName.SLEEP_TRAINING, body)

    @op_method
    def wake_training(self) -> Call[dict]:
        """Bring back what :meth:`sleep_training` offloaded."""
        return self._simple(OpName.WAKE_TRAINING, {})

    @op_method
    def empty_training_cache(self) -> Call[dict]:
        """Release the trainer's cached, unused device memory."""
        return self._simple(OpName.EMPTY_TRAINING_CACHE, {})

    # -- inference --------------------------------------------------------------------------

    @op_method
    def generate(
        self,
        prompts: Sequence | None = None,
        sampling_params: Mapping | Sequence | None = None,
        routing_key: Any = None,
        strict: bool = False,
        *,
        prompt_ids: Sequence | None = None,
    ) -> Call[list]:
        """One result per prompt and sample: ``{text, token_ids, finish_reason, ...}``."""
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

    @op_method
    def log_probs(
        self, prompts: Sequence, completions: Sequence | None = None, top_k: int = 1
    ) -> Call[dict]:
        """Per-token log-probs of completions under the reference (log-prob) model."""
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

    @op_method
    def tokenize(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> Call[list[list[int]]]:
        """The token ids of each text under the sampling model's tokenizer, one list per text
        (``add_special_tokens``: with the BOS/EOS the tokenizer adds; off, as prompts are
        tokenized). Runs on the sampling job; a backend whose engine holds no tokenizer in the
        server (``serve --ray``) refuses it with an :class:`InvalidRequestError` saying so."""
        _raise(OpName.TOKENIZE, texts_problem(texts))
        if not isinstance(add_special_tokens, bool):
            raise TypeError(
                f"tokenize: add_special_tokens must be True or False, got {add_special_tokens!r}"
            )
        body = {"texts": list(texts), "add_special_tokens": add_special_tokens}
        request = self._request(OpName.TOKENIZE, body)
        return Call([request], _only(lambda result: to_python(result["token_ids"])))

    @op_method
    def sync_weights(
        self, cuda_ipc: bool | None = None, low_memory: bool | None = None
    ) -> Call[dict]:
        """Copy the trainer's weights into the sampler (wake, sync, wake KV cache, reset cache)."""
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

    @op_method
    def reset_prefix_cache(
        self, drain: bool = True, timeout_s: float = 60.0, retry_interval_s: float = 0.1
    ) -> Call[dict]:
        """Drop the sampler's cached prompt prefixes (``drain``: after the running requests)."""
        request = self._reset_prefix_cache_request(drain, timeout_s, retry_interval_s)
        return Call([request], _only(dict))

    @op_method
    def sleep_inference(self, level: int = 1) -> Call[dict]:
        """Release the sampler's memory (level 1: weights offloaded, 2: discarded)."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep_inference: level must be 1 or 2, got {level!r}")
        return self._simple(OpName.SLEEP_INFERENCE, {"level": level})

    @op_method
    def wake_inference(self, tags: Sequence[str] | None = None) -> Call[dict]:
        """Bring back what :meth:`sleep_inference` released (``tags``: ``weights``,
        ``kv_cache``; all when None)."""
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

    def _simple(self, op: str, body: Any) -> Call[dict]:
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
