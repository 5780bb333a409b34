"""Engines whose work runs in Ray actors: what a Service holds for a sub-job on the Ray backend.

A :class:`RayTrainingEngine` and a :class:`RayInferenceEngine` implement the engine Protocols
(``contract/engine_protocols.py``) with the same results as the local engines, so the Service, its
queues, its failure handling and every API work unchanged over them. Both reach their actors
through the workers' one generic relay (``call(method, ...)``, any method of the kind's
Protocol): a replica proxy is nothing but that relay (``__getattr__``), and the training proxy
writes out only what data parallelism adds to a method (splitting rows, reducing metrics, which
ranks a save needs).

Training over N worker actors (each a ``TrainingEngine`` with the rank's data-parallel strategy,
:mod:`arctic_platform.engine.data_parallel`):

* The proxy validates the whole request first (the same ``prepare_training_request`` the engine
  runs), so bad input fails before any worker is asked and names the field as on one engine.
* Rows are split across workers by token count (:mod:`arctic_platform.server.dp_split`). With
  N > 1 the workers get ``meta.dp_size`` multiplied by N and the global ``batch_num_tokens`` and
  ``global_batch_size`` of the whole request (the client's, or the counts one engine would use
  for it), so the averaged gradient equals one engine's on the whole batch. With one worker the
  request goes through unchanged and the result is bit-for-bit the local engine's.
* Metrics are reduced from every worker's raw ``.sum``/``.tokens`` pairs; ``forward`` puts rows
  back in their original order.
* Weight sync: rank 0 (every rank with FSDP, which gathers) streams safetensors chunks into the
  object store and the replica fetches them one at a time: bulk bytes go trainer -> replica
  without passing through the process that holds the Service.

Stopping: an op the Service cancels (its job's or its request's token, see
:mod:`arctic_platform.engine.cancellation`) is stopped in the actors: while the proxy waits for
the replies of a stoppable op it polls the tokens of the op's scope and, once one is set, sends
``stop_op`` to each of the op's actors (see :mod:`arctic_platform.server.ray_workers`). It still
waits for every reply, so the actors are idle and consistent when the op ends with
:class:`~arctic_platform.engine.cancellation.OpCancelled`; data-parallel ranks agree on stopping
before each model call (:mod:`arctic_platform.server.data_parallel`). A job cancel also kills the
job's actors; an op whose actors die that way ends as stopped too.

Failures: replies are gathered as they arrive, and the first worker that died
(``RayActorError``, or its reply lost with its node) or raised ends the op with
:class:`WorkerFailure` naming the worker (:class:`WorkerRaised` when it raised and every other
rank answered: the actors are alive and idle, and an op that keeps its engine's state fails
alone, as in the server's process); the Service then marks the job failed and releases its
engines, which kills the job's remaining actors (a rank waiting in a collective for a dead peer
included) and frees its placement group. Other jobs are untouched. When a node of the job is lost
(Ray reports it dead) the error is :class:`NodeLost`, naming the node's id and address and the
workers that ran there, whichever rank failed first. Ray's verdict can lag the first symptom, so
the failure waits up to ``PEER_FAILURE_WAIT_S`` for it: a surviving rank often fails first, its
collective broken by the dead peer (it waits for a peer's death or a node's loss, the cause worth
naming), and an actor on a node that vanished without shutting down is first only unreachable
(``ActorUnavailableError``; it waits for the node to be declared dead).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from arctic_platform.contract.job_config import API_JOB_TYPE
from arctic_platform.contract.ops import OpName
from arctic_platform.contract.results import FORWARD_OUTPUTS, loss_fields
from arctic_platform.engine import cancellation
from arctic_platform.engine.errors import EngineBroken, breaks_engine
from arctic_platform.server.dp_split import merge_rows, split_by_tokens, take_rows
from arctic_platform.server.ray_placement import JobShape, Placement, PlacementWait
from arctic_platform.server.ray_workers import (
    CONCURRENCY_GROUPS,
    RELAYED,
    InferenceWorker,
    Rejected,
    Stopped,
    TrainingWorker,
)
from arctic_platform.tensor_tree import numpy_to_torch, to_object_store

# How long started actors may take to load their model (their resources are reserved by then).
START_TIMEOUT_S = 600.0
# How often a proxy waiting on a stoppable op looks at the op's cancel tokens.
STOP_POLL_S = 0.1
COLLECTIVE_TIMEOUT_S = 1800.0
WEIGHT_CHUNK_BYTES = 64 * 1024 * 1024
# Calls a replica actor runs at once (threads): overlapping generates, which the Service bounds
# by its concurrency slots first (see RayInferenceEngine).
REPLICA_CALLS = 64
# How long a failure waits for Ray's verdict on a peer or a node (see module doc). Ray's default
# health checks (first after 5 s, then every 3 s, 5 misses of up to 10 s each) declare a node
# whose raylet is gone dead after 20-65 s; 30 s missed it on a loaded CI machine.
PEER_FAILURE_WAIT_S = 90.0


def _unreachable(error: Exception) -> bool:
    """Whether a Ray error says an actor could not be reached (its node may be gone)."""
    import ray

    return isinstance(error, ray.exceptions.ActorUnavailableError)


class WorkerFailure(EngineBroken):
    """A worker actor died, or raised while a peer rank may be waiting for it: the job cannot
    continue (the Service fails it)."""


class WorkerRaised(RuntimeError):
    """A worker raised, with an error that did not break its engine (``breaks_engine``), and
    every other rank of the op answered: its actors are alive and idle, so, as for an engine in
    the server's process, the op says whether the job goes on (``Op.keeps_engine_state``)."""


class NodeLost(WorkerFailure):
    """A node the job's workers ran on left the cluster (see module doc)."""


class _Actors:
    """The actors of one sub-job and a gather that fails fast on the first failing actor."""

    def __init__(
        self, sub_job_id: str, role: str, actors: list, names: list[str], nodes: list
    ) -> None:
        self.sub_job_id = sub_job_id
        self.role = role
        self.handles = actors
        self.names = names
        self.nodes = nodes  # each actor's node id (its placement bundle's node), None if unknown
        self.killed = False

    def relay(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on ``rank``'s engine through the worker's generic ``call``, with the
        method's own task name (``TrainingWorker.step``), so Ray's task list and the worker's
        process title still say which engine method runs."""
        worker = TrainingWorker if self.role == "training" else InferenceWorker
        name = f"{worker.__name__}.{method}"
        return self.handles[rank].call.options(name=name).remote(method, *args, **kwargs)

    def describe(self, rank: int) -> str:
        if len(self.handles) == 1:
            return f"{self.role} actor {self.names[rank]}"
        return f"{self.role} worker {rank} of {len(self.handles)} ({self.names[rank]})"

    def gather(
        self,
        refs: Mapping[int, Any],
        what: str,
        timeout: float | None = None,
        *,
        op_id: str | None = None,
    ) -> dict:
        """``{rank: reply}``; raises at the first failure or rejection, and, for the stoppable op
        ``op_id``, stops it when its tokens are cancelled (see module doc)."""
        import ray

        pending = {ref: rank for rank, ref in refs.items()}
        replies: dict[int, Any] = {}
        watching = op_id is not None
        while pending:
            if watching and (reason := cancellation.requested()) is not None:
                self._stop(op_id, reason, list(pending.values()))
                watching = False
            wait = STOP_POLL_S if watching else timeout
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            if not ready and watching:
                continue
            if not ready:
                waiting = ", ".join(self.describe(r) for r in sorted(pending.values()))
                raise TimeoutError(
                    f"{what}: no reply within {timeout:.0f}s from {waiting} (cluster resources "
                    f"available now: {ray.available_resources()})"
                )
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    replies[rank] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    reason = cancellation.requested()
                    died = not isinstance(exc, ray.exceptions.RayTaskError)
                    if died and self.killed and reason is not None:  # a job cancel killed them
                        raise cancellation.OpCancelled(reason) from None
                    raise self._failure(rank, exc, what, pending) from None
        stopped = [r for r in replies.values() if isinstance(r, Stopped)]
        if stopped:
            raise cancellation.OpCancelled(cancellation.requested() or stopped[0].reason)
        _raise_rejection(replies.values())
        return replies

    def _failure(self, rank: int, exc: Exception, what: str, pending: dict) -> RuntimeError:
        """The error that ends ``what`` now that ``rank`` failed with ``exc`` (a Ray error),
        ``pending`` (``{ref: rank}``) not having answered: a lost node, else a dead peer of a
        rank that raised, else ``rank``'s own failure (see module doc): :class:`WorkerRaised`
        when it raised and no peer is left waiting."""
        import ray

        raised = isinstance(exc, ray.exceptions.RayTaskError)
        cause = exc.cause if raised and exc.cause is not None else exc
        # An actor Ray could not reach, ``rank`` itself or a peer that ``rank``'s task called:
        # only its node's fate tells whether a node was lost.
        unreachable = _unreachable(cause)
        deaths = {} if raised else {rank: exc}
        lost = self._lost_nodes()
        if not lost and (unreachable or (raised and pending)):
            lost = self._await_verdict(pending, deaths, until_dead=unreachable)
        if not lost and not unreachable and any(map(_unreachable, deaths.values())):
            lost = self._await_verdict({}, deaths, until_dead=True)  # a peer found unreachable
        if lost:
            return NodeLost("; ".join(self._describe_node(n, lost[n], what) for n in lost))
        if deaths:
            dead, error = min(deaths.items())
            return WorkerFailure(f"{self.describe(dead)} died during {what}: {_first_line(error)}")
        failure = WorkerFailure if pending or breaks_engine(cause) else WorkerRaised
        return failure(
            f"{self.describe(rank)} failed during {what}: "
            f"{type(cause).__name__}: {_first_line(cause)}"
        )

    def _await_verdict(self, pending: dict, deaths: dict, *, until_dead: bool) -> dict:
        """Wait up to ``PEER_FAILURE_WAIT_S`` for Ray to report a node of the job lost (returned)
        or, unless ``until_dead`` (an actor Ray could not reach: only its node's fate tells),
        for a rank of ``pending`` to die (added to ``deaths``) or all of them to answer."""
        import ray

        deadline = time.monotonic() + PEER_FAILURE_WAIT_S
        while time.monotonic() < deadline:
            if lost := self._lost_nodes():
                return lost
            if not until_dead and (deaths or not pending):
                break
            if not pending:
                time.sleep(STOP_POLL_S)
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=STOP_POLL_S)
            for ref in ready:
                peer = pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError:
                    pass  # another symptom; the first rank's error stands
                except ray.exceptions.RayError as exc:
                    deaths[peer] = exc
        return self._lost_nodes()

    def _lost_nodes(self) -> dict[str, dict]:
        """The job's nodes Ray reports dead: ``{node id: its ray.nodes() entry}``."""
        import ray

        mine = {node for node in self.nodes if node}
        if not mine:
            return {}
        return {n["NodeID"]: n for n in ray.nodes() if n["NodeID"] in mine and not n["Alive"]}

    def _describe_node(self, node: str, entry: dict, what: str) -> str:
        """``node <id> (<address>) lost during <what> (<Ray's reason>): it ran <workers>``."""
        why = entry.get("DeathReasonMessage") or ""
        ran = ", ".join(self.describe(r) for r, n in enumerate(self.nodes) if n == node)
        return (
            f"node {node} ({entry.get('NodeManagerAddress', 'unknown address')}) lost during "
            f"{what}{f' ({why})' if why else ''}: it ran {ran}"
        )

    def _stop(self, op_id: str, reason: str, ranks: list[int]) -> None:
        """Ask the actors of ``ranks`` to stop ``op_id`` (in their ``control`` group)."""
        for rank in ranks:
            stop = self.handles[rank].stop_op.options(concurrency_group="control")
            stop.remote(op_id, reason)

    def kill(self) -> None:
        import ray

        self.killed = True
        for actor in self.handles:
            with contextlib.suppress(Exception):  # already gone: nothing to release
                ray.kill(actor, no_restart=True)


@dataclass(frozen=True)
class ChunkWeights:
    """A Ray trainer's weights at one moment: object-store refs of their merged safetensors
    chunks, which hold those weights for as long as the refs are kept (Ray spills them to disk
    past its memory)."""

    refs: list

    def load_into(self, sampler: RayInferenceEngine) -> dict:
        """Hand the refs to ``sampler``'s replica, which fetches the chunks one at a time."""
        return sampler.load_weight_chunks(self.refs)


class RayTrainingEngine:
    """A training sub-job over ``workers`` data-parallel actors (see module doc)."""

    def __init__(
        self,
        *,
        sub_job_id: str,
        config,
        strategy: str,
        workers: int,
        placement: Placement,
        on_close: Callable[[], None],
    ) -> None:
        import ray

        self.config = config
        self.strategy = strategy
        self.workers = workers
        self._on_close = on_close
        remote = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(TrainingWorker)
        names = [_actor_name(sub_job_id, f"rank-{r}") for r in range(workers)]
        handles = [
            remote.options(name=names[r], **placement.options("training", r)).remote(r, workers)
            for r in range(workers)
        ]
        nodes = [placement.node_of("training", r) for r in range(workers)]
        self.actors = _Actors(sub_job_id, "training", handles, names, nodes)
        try:
            addr, port = "", 0
            if workers > 1:
                first = self.actors.gather(
                    {0: handles[0].rendezvous.remote(COLLECTIVE_TIMEOUT_S)},
                    "startup",
                    START_TIMEOUT_S,
                )
                addr, port = first[0]
            started = self.actors.gather(
                {
                    r: h.start.remote(config, strategy, addr, port, COLLECTIVE_TIMEOUT_S)
                    for r, h in enumerate(handles)
                },
                "startup",
                START_TIMEOUT_S,
            )
        except BaseException:
            self.close()
            raise
        self.vocab_size = int(started[0]["vocab_size"])
        # Every rank loads the same model on the same kind of device: rank 0's speak for all.
        self.setting_fallbacks: dict[str, str] = dict(started[0]["setting_fallbacks"])
        self.max_model_len = int(started[0]["max_model_len"])

    # -- compute --------------------------------------------------------------------------

    def forward_backward(
        self,
        batch: Mapping,
        meta: Mapping | None = None,
        processing: Mapping | None = None,
        *,
        with_logprobs: bool = False,
    ) -> dict:
        from arctic_platform.engine.metrics import finalize_metrics

        request = self._validate(batch, meta, processing, backward=True)
        parts, replies = self._on_shards(
            "forward_backward", request, batch, meta, processing, with_logprobs=with_logprobs
        )
        sums = _summed(replies[r]["metric_sums"] for r in range(self.workers))
        metrics = finalize_metrics(sums)
        out = {**loss_fields(metrics), "metrics": metrics, "metric_sums": sums}
        if with_logprobs:
            out["logprobs"] = _merged(parts, replies, "logprobs", request.batch.size)
        return out

    def forward(
        self, batch: Mapping, meta: Mapping | None = None, processing: Mapping | None = None
    ) -> dict:
        from arctic_platform.engine.metrics import finalize_metrics

        request = self._validate(batch, meta, processing, backward=False)
        parts, replies = self._on_shards("forward", request, batch, meta, processing)
        active = [r for r in range(self.workers) if len(parts[r])]
        out: dict[str, Any] = {}
        for name in FORWARD_OUTPUTS:
            if name in replies[active[0]]:
                out[name] = _merged(parts, replies, name, request.batch.size)
        out["metrics"] = {}
        if request.loss is not None:
            out["metric_sums"] = _summed(replies[r]["metric_sums"] for r in active)
            out["metrics"] = finalize_metrics(out["metric_sums"])
            out.update(loss_fields(out["metrics"]))
        return out

    def step(self, learning_rate: float | None = None, *, adam=None) -> dict:
        """The optimizer step on every worker (``adam``: Tinker's per-step AdamW settings)."""
        return self._on_all("step", learning_rate, adam=adam)[0]

    # -- checkpoints and weights ----------------------------------------------------------

    def save_checkpoint(
        self,
        path=None,
        *,
        step: int | None = None,
        export_hf: bool = False,
        save_total_limit: int | None = None,
    ) -> dict:
        ranks = self._gathering_ranks()
        replies = self.actors.gather(
            {
                r: self.actors.relay(
                    r,
                    "save_checkpoint",
                    None if path is None else str(path),
                    step=step,
                    export_hf=export_hf,
                    save_total_limit=save_total_limit,
                )
                for r in ranks
            },
            OpName.SAVE,
        )
        return replies[0]

    def load_checkpoint(
        self, path=None, *, step: int | None = None, optimizer: bool = True
    ) -> dict:
        path = None if path is None else str(path)
        return self._on_all("load_checkpoint", path, step=step, optimizer=optimizer)[0]

    def sync_weights_to(self, target: RayInferenceEngine) -> dict:
        """Stream the current weights into ``target``'s replica through the object store."""
        return self.weight_snapshot().load_into(target)

    def weight_snapshot(self) -> ChunkWeights:
        """The model cannot be read from here, so the snapshot is taken where it lives: rank 0
        puts the merged weights' safetensors chunks in the object store (every rank gathers
        with FSDP), and the refs hold those weights for as long as they are kept."""
        replies = self.actors.gather(
            {
                r: self.actors.handles[r].weight_chunks.remote(WEIGHT_CHUNK_BYTES)
                for r in self._gathering_ranks()
            },
            OpName.WEIGHT_SYNC,
        )
        return ChunkWeights(replies[0])

    # -- colocation -----------------------------------------------------------------------

    def sleep(self, mode: str = "all") -> dict:
        return _combine(self._on_all("sleep", mode))

    def wake(self) -> dict:
        return _combine(self._on_all("wake"))

    def empty_cache(self) -> dict:
        return _combine(self._on_all("empty_cache"))

    def close(self) -> None:
        """Kill the workers and give back the job's placement; idempotent."""
        _close(self)

    # -- internals ------------------------------------------------------------------------

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> dict:
        """Every rank's engine runs ``method`` (the workers' generic relay); replies by rank."""
        return self.actors.gather(
            {r: self.actors.relay(r, method, *args, **kwargs) for r in range(self.workers)},
            method.replace("_", "-"),
        )

    def _on_shards(
        self, method: str, request, batch: Mapping, meta: Mapping | None, processing, **kwargs
    ) -> tuple[list[np.ndarray], dict]:
        """Each worker runs ``method`` on its shard of ``batch`` (with ``kwargs``), stoppable:
        ``(rows per worker, replies)``."""
        parts, shards = self._split(batch, request)
        meta_out = self._worker_meta(request, meta)
        op_id = uuid.uuid4().hex
        relay = self.actors.relay
        replies = self.actors.gather(
            {
                r: relay(r, method, shards[r], meta_out, processing, op_id=op_id, **kwargs)
                for r in range(self.workers)
            },
            method.replace("_", "-"),
            op_id=op_id,
        )
        return parts, replies

    def _gathering_ranks(self) -> list[int]:
        """Ranks a save or export needs: rank 0 holds everything, unless FSDP shards it."""
        if self.strategy == "fsdp" and self.workers > 1:
            return list(range(self.workers))
        return [0]

    def _validate(self, batch, meta, processing, *, backward: bool):
        from arctic_platform.engine.forward import prepare_training_request

        with warnings.catch_warnings():
            # Object-store arrays are read-only; validation only reads them.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return prepare_training_request(
                batch, meta, processing, self.config, model=self, backward=backward
            )

    def _split(self, batch: Mapping, request) -> tuple[list[np.ndarray], list[dict | None]]:
        size = request.batch.size
        tokens = request.batch.attention_mask.sum(1).numpy()
        groups = request.prompt_groups
        shared = [] if groups is None else groups.shared
        parts = split_by_tokens(
            tokens,
            self.workers,
            groups=[groups.groups[k] for k in shared],
            saved=[groups.saved(k) for k in shared],
        )
        arrays = to_object_store(dict(batch))
        shards = [take_rows(arrays, rows, size) if len(rows) else None for rows in parts]
        return parts, shards

    def _worker_meta(self, request, meta: Mapping | None) -> dict:
        """The meta every worker gets: the client's, plus global counts when N > 1."""
        out = dict(meta or {})
        if self.workers == 1:
            return out
        out["dp_size"] = request.meta.dp_size * self.workers
        aggregation = getattr(request.loss, "agg", None)
        if aggregation is not None:
            out["batch_num_tokens"] = aggregation.num_tokens
            out["global_batch_size"] = aggregation.num_seqs
        return out


class RayInferenceEngine:
    """A sampling or log-prob sub-job served by one replica actor.

    The actor takes up to :data:`REPLICA_CALLS` calls at once, so that when its engine decodes
    concurrent calls together (our sampler's running batch) the Service's overlapping generates
    join one decode there as they do in the server's process: ``concurrent_generate`` is the
    replica engine's. Every other op stays alone on the sub-job's queue, so only generates
    overlap in the actor; a stop has its own concurrency group."""

    # Until the replica says otherwise (at start), its generates do not overlap.
    concurrent_generate = False
    # The model's tokenizer lives in the actor with the engine, not here (``tokenize`` is a 400).
    tokenizer = None

    def __init__(
        self,
        *,
        sub_job_id: str,
        kind: str,
        config,
        placement: Placement,
        index: int,
        on_close: Callable[[], None],
    ) -> None:
        import ray

        self.kind = kind
        self._on_close = on_close
        name = _actor_name(sub_job_id, "replica")
        handle = (
            ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(InferenceWorker)
            .options(name=name, max_concurrency=REPLICA_CALLS, **placement.options(kind, index))
            .remote(kind)
        )
        self.actors = _Actors(sub_job_id, kind, [handle], [name], [placement.node_of(kind, index)])
        try:
            started = self.actors.gather(
                {0: handle.start.remote(config)}, "startup", START_TIMEOUT_S
            )
        except BaseException:
            self.close()
            raise
        self.vocab_size = int(started[0]["vocab_size"])
        self.max_model_len = int(started[0]["max_model_len"])
        self.concurrent_generate = bool(started[0]["concurrent_generate"])

    def __getattr__(self, name: str) -> Any:
        """Every method of the kind's engine Protocol, relayed to the replica (its generic
        ``call``): the proxy keeps no copy of the engine's methods."""
        kind = self.__dict__.get("kind")
        if kind is None or name not in RELAYED[kind]:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return functools.partial(self._call, name)

    def load_weight_chunks(self, refs: list) -> dict:
        handle = self.actors.handles[0]
        return self.actors.gather({0: handle.load_weight_chunks.remote(refs)}, OpName.WEIGHT_SYNC)[
            0
        ]

    def close(self) -> None:
        """Kill the replica and give back the job's placement; idempotent."""
        _close(self)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the replica's engine, stoppable; tensors cross as numpy arrays."""
        op_id = uuid.uuid4().hex
        args, kwargs = to_object_store(args), to_object_store(kwargs)
        remote = self.actors.relay(0, method, *args, op_id=op_id, **kwargs)
        reply = self.actors.gather({0: remote}, method, op_id=op_id)[0]
        return numpy_to_torch(reply, copy_read_only=True)


class RayEngines:
    """Builds the Ray engines of one Service and owns each job's placement (see module doc)."""

    def __init__(self, service) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._placements: dict[str, tuple[Placement, int]] = {}

    def build(self, sub, source: dict | None):
        from arctic_platform.server.engines import inference_config_for, training_config_for

        spec = sub.spec
        placement = self._acquire(sub.job_id)
        release = _once(lambda: self._release(sub.job_id))
        try:
            if sub.kind == "training":
                config = training_config_for(self.service, sub, source, device=placement.device)
                engine = RayTrainingEngine(
                    sub_job_id=sub.sub_job_id,
                    config=config,
                    strategy=spec.training_config.data_parallel or "ddp",
                    workers=spec.training_config.n_gpus,
                    placement=placement,
                    on_close=release,
                )
                if source is not None:
                    try:
                        engine.load_checkpoint(source["path"])
                    except BaseException:
                        engine.close()
                        raise
                return engine
            return RayInferenceEngine(
                sub_job_id=sub.sub_job_id,
                kind=sub.kind,
                config=inference_config_for(self.service, sub, source, device=placement.device),
                placement=placement,
                index=int(sub.sub_job_id.rsplit(":", 1)[1]),
                on_close=release,
            )
        except BaseException:
            release()
            raise

    def _acquire(self, job_id: str) -> Placement:
        """The job's placement, reserved by its first sub-job (a job's sub-jobs are built one
        after the other on its build thread); the wait holds no lock, so other jobs come and
        go meanwhile."""
        with self._lock:
            if job_id in self._placements:
                placement, users = self._placements[job_id]
                self._placements[job_id] = (placement, users + 1)
                return placement
        settings = self.service.settings
        placement = Placement.create(
            name=f"arctic-platform/{job_id}",
            device=settings.device,
            shape=self._shape(job_id),
            colocate=settings.colocate,
            wait=PlacementWait(
                timeout_s=settings.placement_timeout_s,
                autoscaling=settings.ray_autoscaling,
                note=lambda line: self.service.note(job_id, line),
                holders=lambda: self._holders(job_id),
            ),
        )
        with self._lock:
            self._placements[job_id] = (placement, 1)
        return placement

    def _holders(self, job_id: str) -> str:
        """This server's other jobs holding placements: ``job 1a2b (2 bundle(s) (0.68 CPU))``."""
        with self._lock:
            held = [(other, p) for other, (p, _) in self._placements.items() if other != job_id]
        return ", ".join(f"job {other} ({p.describe()})" for other, p in held)

    def _release(self, job_id: str) -> None:
        with self._lock:
            placement, users = self._placements[job_id]
            if users > 1:
                self._placements[job_id] = (placement, users - 1)
                return
            del self._placements[job_id]
        placement.release()

    def _shape(self, job_id: str) -> JobShape:
        owner = self.service.owner_of(job_id)
        subs = self.service.get_job(job_id, owner=owner)["sub_jobs"]
        kinds = [s["job_type"] for s in subs]
        workers = sum(s["training_config"]["n_gpus"] for s in subs if s["job_type"] == "training")
        return JobShape(
            training_workers=workers,
            samplers=kinds.count("sampling"),
            scorers=kinds.count(API_JOB_TYPE["log_prob"]),
        )


_FACTORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FACTORIES_LOCK = threading.Lock()


def build_ray_engine(service, sub, source: dict | None):
    """The Ray engine of ``sub`` (the Service's engine builder on the Ray backend)."""
    with _FACTORIES_LOCK:
        factory = _FACTORIES.get(service)
        if factory is None:
            factory = _FACTORIES[service] = RayEngines(service)
    return factory.build(sub, source)


# -- helpers ------------------------------------------------------------------------------------


def _actor_name(sub_job_id: str, what: str) -> str:
    """Actor names show up in ``ray list actors``; a tool can find a job's actors by them."""
    return f"arctic-platform/{sub_job_id}/{what}"


def _raise_rejection(replies) -> None:
    """Re-raise a worker's refusal as the exception the Service maps to a 4xx."""
    from arctic_platform.engine.errors import (
        CheckpointNotFound,
        CheckpointWriteError,
        EngineInputError,
        SamplerStateError,
    )

    rejections = [r for r in replies if isinstance(r, Rejected)]
    if not rejections:
        return
    first = next((r for r in rejections if r.kind != "peer"), rejections[0])
    if first.kind == "state":
        raise SamplerStateError(first.message)
    if first.kind == "write":
        raise CheckpointWriteError(first.errno, first.message)
    if first.kind == "missing":
        raise CheckpointNotFound(first.field, first.message)
    raise EngineInputError(first.field or "batch", first.message)


def _summed(parts) -> dict[str, float]:
    """The raw metric pairs of several workers added up (what one engine's ``metric_sums`` is)."""
    from arctic_platform.engine.metrics import MetricSums

    total = MetricSums()
    for part in parts:
        total.add(part)
    return total.raw()


def _merged(parts: list[np.ndarray], replies: dict, name: str, size: int):
    """Output ``name`` of the workers that had rows, back in the request's row order."""
    pieces = [(parts[r], replies[r][name]) for r in replies if len(parts[r])]
    return numpy_to_torch(merge_rows(pieces, size))


def _combine(answers: dict[int, dict]) -> dict:
    """One answer for the job: the workers' common answer, or rank 0's plus each worker's."""
    values = [answers[r] for r in sorted(answers)]
    if all(v == values[0] for v in values):
        return values[0]
    return {**values[0], "per_worker": values}


def _close(engine) -> None:
    engine.actors.kill()
    on_close, engine._on_close = engine._on_close, None
    if on_close is not None:
        on_close()


def _first_line(value: Any) -> str:
    text = str(value).strip()
    return text.splitlines()[0] if text else type(value).__name__


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = threading.Event()

    def run() -> None:
        if not done.is_set():
            done.set()
            fn()

    return run
