"""The Tinker ops on our Service: each call validates at once and returns a request id, whose
future runs on the Service sub-job queues (so Tinker ops and native ops share order, the
concurrency slots and failure handling).

Validation that can happen before queueing (unknown model, malformed datums, unknown loss keys)
raises :class:`BadRequest`/:class:`NotFound`, which the routes answer as HTTP errors; failures
found while running come back through the future as ``{"error", "category"}``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from arctic_platform.contract.bodies import learning_rate_problem
from arctic_platform.contract.engine_protocols import TrainingEngineProtocol
from arctic_platform.contract.job_ids import parent_of
from arctic_platform.contract.ops import OpName
from arctic_platform.contract.states import LIVE_JOB_STATES
from arctic_platform.engine.builtin import resolve_model_path
from arctic_platform.server.errors import (
    BadRequest,
    Conflict,
    PayloadTooLarge,
    ServiceError,
    TooManyRequests,
    failure_of,
)
from arctic_platform.server.limits import MIB
from arctic_platform.server.ops import check_context, check_generate
from arctic_platform.server.pending_work import PendingWork, payload_nbytes
from arctic_platform.server.service import Service
from arctic_platform.server.tinker import bodies, codec, losses
from arctic_platform.server.tinker.checkpoints import (
    TINKER_DIR,
    TinkerCheckpoints,
    TinkerPath,
    check_name,
    check_ttl,
)
from arctic_platform.server.tinker.futures import FutureStore, OpResult
from arctic_platform.server.tinker.job_starts import JobStarts
from arctic_platform.server.tinker.model_samplers import ModelSamplingJobs, cancel_jobs
from arctic_platform.server.tinker.sample_batcher import SampleBatcher
from arctic_platform.server.tinker.session_reaper import SESSION_TIMEOUT_S, SessionReaper
from arctic_platform.server.tinker.snapshot_loads import SnapshotLoad, SnapshotWeights
from arctic_platform.server.tinker.state import FIRST_SEQ_ID, Sampler, TinkerState, TrainingRun

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A training client's request, validated: the runner that performs it on the run's trainer,
    and the bytes that runner holds until it has run, where they are not its body's. A
    forward_backward's padded batch can be a hundred times its protobuf (datums of one token
    beside a long one pad to the long one's width), and a request can wait parked for its
    ``seq_id``'s turn, so it is the batch that counts among the owner's unfinished ops
    (``pending_work.py``)."""

    runner: Callable[[Any], OpResult]
    nbytes: int | None = None  # None: its body's (what the runner holds of the request)


# How long create_model (and sampling on a fresh sampler) waits for the engines to load.
STARTUP_TIMEOUT_S = 1800.0
# LoRA target modules by Tinker's train_attn / train_mlp switches (Llama/Qwen layer names);
# both together are peft's "all-linear" (every linear layer but the output head, which
# train_unembed adds: engine/models.apply_lora).
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
# The op name a refused asample's limit error gives (the route the tenant called).
SAMPLE_OP = "asample"


class TinkerOps:
    """Every Tinker op over one Service (see module doc)."""

    def __init__(self, service: Service, session_timeout_s: float = SESSION_TIMEOUT_S) -> None:
        self.service = service
        self.state = TinkerState(service.store)
        self.reaper = SessionReaper(
            self.state, self.finish_session, session_timeout_s, sweep=self._end_orphaned_requests
        )
        self.futures = FutureStore(service.limits.max_retained_results_mb * MIB)
        self.checkpoints = TinkerCheckpoints(
            service.checkpoints,
            service.store,
            service.paths,
        )
        self.checkpoints.recover(service.paths.root.glob(f"*/{TINKER_DIR}"))
        self.checkpoints.adopt_legacy(service.paths.root.glob(f"*/{TINKER_DIR}"), self._job_of)
        # Work waiting for a job's engines to load, called once they have.
        self._starts = JobStarts(service, timeout_s=STARTUP_TIMEOUT_S)
        self.model_jobs = ModelSamplingJobs(service)
        self._batcher = SampleBatcher()
        self._snapshot_weights = SnapshotWeights()

    def _job_of(self, run: dict) -> str | None:
        """The id of the job a run of an earlier server made (the newest of that name)."""
        made = [
            job
            for job in self.service.jobs.all()
            if job.owner == run["owner"] and job.experiment_name == _experiment(run["model_id"])
        ]
        return max(made, key=lambda job: job.created_at).job_id if made else None

    def start(self) -> None:
        """Start the background work (the stale-session reaper); the app does at startup."""
        self.reaper.start()

    def close(self) -> None:
        self.reaper.stop()
        self._starts.close()

    # -- sessions ---------------------------------------------------------------------------

    def finish_session(self, session_id: str, owner: str | None) -> None:
        """Finish a session (idempotent): cancel the jobs it created (but a model sampling job
        another live session uses, or a sample runs on), drop its runs' snapshots, end the
        requests its runs had parked waiting for a ``seq_id``, and let it leave memory."""
        session = self.state.session(session_id, owner, active=False)
        if session.finished:
            return
        session.finished = True
        self.state.forget(session)
        for run in self.state.runs_of(session_id):
            run.drop_snapshots()
        kept, released = self.model_jobs.after_finish(session)  # shared sampling jobs
        own = [j for j in session.job_ids if j not in kept and j not in released]
        cancel_jobs(self.service, own + released, owner)
        for run in self.state.runs_of(session_id):  # their jobs ended: parked requests fail
            run.sequencer.flush()

    def _end_orphaned_requests(self) -> None:
        """End the requests parked in runs whose job ended on its own (failed, expired idle):
        the ``seq_id`` they wait for can no longer run, and each holds its body (and its bytes
        among the owner's unfinished ops) until its session ends."""
        for run in self.state.all_runs():
            if not run.sequencer.parked:
                continue
            with contextlib.suppress(ServiceError):  # a job no longer known: ended too
                if self.service.job_status(run.job_id, owner=run.owner) in LIVE_JOB_STATES:
                    continue
            run.sequencer.flush()

    # -- training runs ----------------------------------------------------------------------

    def create_model(self, body: bodies.CreateModelBody, owner: str | None) -> str:
        session = self.state.session(body.session_id, owner)
        if body.optimizer_config.type != "adamw":
            raise BadRequest(
                f"optimizer_config.type: {body.optimizer_config.type!r} is not supported; adamw",
                field="optimizer_config.type",
            )
        lora = body.lora_config or bodies.LoraConfig(rank=32)
        model_id = f"{session.session_id}:train:{body.model_seq_id}"
        run = self._start_run(model_id, session, owner, body.base_model, lora)
        return self._wait_for_run(run, owner, lambda: {"model_id": model_id})

    def _start_run(self, model_id, session, owner, base_model: str, lora) -> TrainingRun:
        modules: Any = "all-linear"
        if not (lora.train_attn and lora.train_mlp):
            modules = (ATTN_MODULES if lora.train_attn else []) + (
                MLP_MODULES if lora.train_mlp else []
            )
            if not modules:
                raise BadRequest(
                    "lora_config: train_attn or train_mlp must be true", field="lora_config"
                )
        training = {
            "job_type": "training",
            "model_name": base_model,
            "training_config": {
                # Tinker's AdamParams carry lr, betas, eps, decay and clipping with every step.
                "gradient_clipping": 0.0,
                "peft_config": {
                    "r": lora.rank,
                    "alpha": lora.rank,
                    "target_modules": modules,
                    "train_unembed": lora.train_unembed,
                },
            },
        }
        if lora.seed is not None:
            training["seed"] = lora.seed
        request = {
            "experiment_name": _experiment(model_id),
            "sub_job_configs": [training, {"job_type": "sampling", "model_name": base_model}],
        }
        self.state.check_new_run(model_id)
        info = self.service.create_job(request, owner=owner)
        session.hold(info["job_id"], lambda job_id: cancel_jobs(self.service, [job_id], owner))
        run = TrainingRun(
            model_id=model_id,
            owner=owner,
            session_id=session.session_id,
            base_model=base_model,
            lora_rank=lora.rank,
            job_id=info["job_id"],
        )
        try:
            self.state.add_run(run)
        except Conflict:  # another create_model of the same id won the race: this job is no one's
            cancel_jobs(self.service, [run.job_id], owner)
            raise
        self.checkpoints.record_run(
            model_id, owner=owner, job_id=run.job_id, base_model=base_model, rank=lora.rank
        )
        return run

    def _wait_for_run(self, run: TrainingRun, owner, answer) -> str:
        outer: Future = Future()
        self._starts.then(
            run.job_id, owner, outer, lambda: outer.set_result(OpResult(json=answer()))
        )
        return self.futures.add(owner, outer)

    def get_info(self, model_id: str, owner: str | None) -> dict:
        run = self.state.run(model_id, owner)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": "lora",
                "model_name": run.base_model,
                # The SDK loads it with AutoTokenizer.from_pretrained: a local folder for builtins.
                "tokenizer_id": resolve_model_path(run.base_model),
            },
            "is_lora": True,
            "lora_rank": run.lora_rank,
            "model_name": run.base_model,
        }

    def forward_backward(self, request: codec.ForwardBackwardRequest, owner: str | None) -> str:
        run = self.state.run(request.model_id, owner)
        op = OpName.FORWARD if request.forward_only else OpName.FORWARD_BACKWARD

        def prepare():
            data = codec.decode_data(request)
            spec = losses.check_loss(request.loss_fn, request.loss_fn_config)
            # the on-prem batch limits, checked before the batch is allocated
            tokens = self.service.limits.check_batch_shape(op, *losses.batch_shape(data))
            batch = losses.build_batch(data, spec)
            processing = losses.processing_for(request.loss_fn, request.loss_fn_config)
            trainer = self.service.resolve(run.training_sub_job, owner=owner).engine
            vocab_size = getattr(trainer, "vocab_size", None)
            if vocab_size is not None:
                losses.check_vocabulary(data, vocab_size)
            if trainer is not None:  # still loading: the engine refuses it when it runs
                check_context(
                    trainer,
                    op,
                    batch,
                    field="data[{row}].model_input",
                    what="the datum's model_input with its last target token",
                )

            # The parked request keeps its batch and the datums' lengths, not the protobuf nor
            # the decoded datums: the batch alone is what it holds, and what is counted.
            lengths = [d.tokens.size for d in data]
            forward_only = request.forward_only

            def runner(engine) -> OpResult:
                if forward_only:
                    out = engine.forward(batch, None, processing)
                else:
                    out = engine.forward_backward(batch, None, processing, with_logprobs=True)
                self.service.metrics.add_tokens(op, tokens)  # counted as the on-prem op counts
                body = codec.encode_forward_backward_output(
                    losses.per_datum(out["logprobs"], lengths),
                    losses.loss_metrics(out["metric_sums"]),
                )
                return OpResult(protobuf=body)

            return Prepared(runner, nbytes=payload_nbytes([batch, lengths]))

        return self._sequenced(run, request.seq_id, owner, op, prepare, request.nbytes)

    def optim_step(self, body: bodies.OptimStepBody, owner: str | None) -> str:
        from arctic_platform.engine.trainer import AdamSettings

        run = self.state.run(body.model_id, owner)

        def prepare():
            p = body.adam_params
            if p is None:
                raise BadRequest(
                    "adam_params: required (only the Adam optimizer is supported)",
                    field="adam_params",
                )
            problem = learning_rate_problem(p.learning_rate)
            if problem is not None:
                raise BadRequest(f"adam_params.{problem}", field=f"adam_params.{problem.field}")
            for name, value in p:  # JSON admits 1e999; an infinite decay wrecks the weights
                if not math.isfinite(value):
                    raise BadRequest(
                        f"adam_params.{name}: must be finite, got {value}",
                        field=f"adam_params.{name}",
                    )
            adam = AdamSettings(
                betas=(p.beta1, p.beta2),
                eps=p.eps,
                weight_decay=p.weight_decay,
                grad_clip=p.grad_clip_norm,
            )

            def runner(engine) -> OpResult:
                out = engine.step(p.learning_rate, adam=adam)
                lr = p.learning_rate
                return OpResult(
                    json={"metrics": {"grad_norm:mean": out["grad_norm"], "learning_rate:mean": lr}}
                )

            return Prepared(runner)

        return self._sequenced(run, body.seq_id, owner, OpName.STEP, prepare)

    def save_state(self, body: bodies.SaveWeightsBody, owner: str | None) -> str:
        """``save_state``: LoRA weights and Adam state under ``weights/<name>``."""
        run = self.state.run(body.model_id, owner)
        return self._save(
            run,
            body,
            owner,
            "weights",
            body.path or None,
            overwrite=body.overwrite,
            export_hf=False,
            answer=lambda path: {"type": "save_weights"},
        )

    def save_for_sampler(self, body: bodies.SaveForSamplerBody, owner: str | None) -> str:
        """``save_weights_for_sampler``: merged HF weights under ``sampler_weights/<name>``, or
        without a name a snapshot for a sampling client (:meth:`_sync_to_sampler`)."""
        run = self.state.run(body.model_id, owner)
        if body.path is None:
            return self._sequenced(
                run,
                body.seq_id,
                owner,
                OpName.WEIGHT_SYNC,
                lambda: Prepared(self._sync_to_sampler(run, owner)),
            )
        return self._save(
            run,
            body,
            owner,
            "sampler_weights",
            body.path,
            overwrite=True,
            export_hf=True,
            answer=lambda path: {"type": "save_weights_for_sampler"},
        )

    def save_external(self, body: bodies.SaveWeightsBody, owner: str | None) -> str:
        """``save_weights_external``: merged HF weights under ``external_weights/<name>``."""
        run = self.state.run(body.model_id, owner)

        def answer(path: TinkerPath) -> dict:
            files = self.checkpoints.exported_files(path, owner).values()
            return {
                "size_bytes": sum(f.stat().st_size for f in files),
                "type": "save_weights_external",
            }

        return self._save(
            run,
            body,
            owner,
            "external_weights",
            body.path,
            overwrite=True,
            export_hf=True,
            answer=answer,
        )

    def _save(
        self,
        run: TrainingRun,
        body: bodies.SaveWeightsBody | bodies.SaveForSamplerBody,
        owner: str | None,
        kind: str,
        name: str | None,
        *,
        overwrite: bool,
        export_hf: bool,
        answer: Callable[[TinkerPath], dict],
    ) -> str:
        """Save the run's trainer as ``tinker://<run>/<kind>/<name>`` in the client's op order;
        the future answers ``{"path", **answer(path)}``."""

        def prepare():
            check_ttl(body.ttl_seconds)
            path = TinkerPath(run.model_id, kind, check_name(name))
            sub = self.service.resolve(run.training_sub_job, owner=owner)

            def runner(engine) -> OpResult:
                self.checkpoints.save(
                    path,
                    owner,
                    sub,
                    lambda folder: engine.save_checkpoint(folder, export_hf=export_hf),
                    overwrite=overwrite,
                    ttl_seconds=body.ttl_seconds,
                )
                return OpResult(json={"path": str(path), **answer(path)})

            return Prepared(runner)

        return self._sequenced(run, body.seq_id, owner, OpName.SAVE, prepare)

    def _sync_to_sampler(self, run: TrainingRun, owner):
        """``save_weights_and_get_sampling_client``: a snapshot of the trainer's weights (its
        engine's ``weight_snapshot``), which the run's sampler loads before sampling for it."""

        def runner(engine: TrainingEngineProtocol) -> OpResult:
            snapshot = (run.model_id, run.add_snapshot(engine.weight_snapshot()))
            sampler = self.state.add_sampler(
                Sampler(
                    uuid.uuid4().hex,
                    owner,
                    run.session_id,
                    run.base_model,
                    sub_job_id=run.sampling_sub_job,
                    snapshot=snapshot,
                )
            )
            return OpResult(json={"sampling_session_id": sampler.sampler_id})

        return runner

    def _snapshot_loader(self, sampler: Sampler, owner) -> tuple[str, SnapshotLoad]:
        """``(batch key, load)`` for a snapshot sampler: what its drains do about the sampling
        sub-job's weights (``snapshot_loads.py``)."""
        model_id, number = sampler.snapshot
        run = self.state.run(model_id, owner)
        snapshot = run.snapshot(number)  # a dropped snapshot is refused before a request id
        load = self._snapshot_weights.load_of(sampler.sub_job_id, (model_id, number), snapshot)
        return f"{sampler.sub_job_id}@{number}", load

    def load_weights(self, body: bodies.LoadWeightsBody, owner: str | None) -> str:
        def checked_path():
            path = TinkerPath.parse(body.path)
            if path.kind != "weights":
                raise BadRequest(
                    f"path: {path} holds sampler weights; load a weights/ (state) path",
                    field="path",
                )
            return path, self.checkpoints.resolve(path, owner)

        def load(engine, path, directory) -> dict:
            engine.load_checkpoint(directory, optimizer=body.optimizer)
            return {"path": str(path), "type": "load_weights"}

        if body.model_id is not None:
            run = self.state.run(body.model_id, owner)

            def prepare():
                path, directory = checked_path()
                return Prepared(lambda engine: OpResult(json=load(engine, path, directory)))

            return self._sequenced(run, body.seq_id, owner, OpName.LOAD_CHECKPOINT, prepare)
        path, directory = checked_path()
        if body.session_id is None or body.model_seq_id is None:
            raise BadRequest(
                "load_weights: give model_id, or session_id and model_seq_id", field="model_id"
            )
        session = self.state.session(body.session_id, owner)
        record = self.checkpoints.run_record(path.model_id, owner)
        base_model = body.base_model or record["base_model"]
        model_id = f"{session.session_id}:train:{body.model_seq_id}"
        lora = bodies.LoraConfig(rank=record["lora_rank"])
        run = self._start_run(model_id, session, owner, base_model, lora)

        outer: Future = Future()

        def start_load() -> None:  # once the run's engines have loaded
            sub = self.service.resolve(run.training_sub_job, owner=owner)
            loading = self.service.executor.submit_runner(
                sub,
                OpName.LOAD_CHECKPOINT,
                lambda: OpResult(json={**load(sub.engine, path, directory), "model_id": model_id}),
            )
            loading.add_done_callback(lambda f: _copy_outcome(f, outer))

        self._starts.then(run.job_id, owner, outer, start_load)
        return self.futures.add(owner, outer)

    # -- sampling ---------------------------------------------------------------------------

    def create_sampling_session(self, body: bodies.CreateSamplingSessionBody, owner) -> str:
        session = self.state.session(body.session_id, owner)
        sampler = self._sampler_for(session, owner, body.base_model, body.model_path)
        return sampler.sampler_id

    def _sampler_for(self, session, owner, base_model: str | None, model_path: str | None):
        """A sampler on the owner's (shared, releasable) job on a checkpoint or a base model; the
        job starts now, so that its model loads while the client prepares its first sample."""
        if model_path is not None:
            path = TinkerPath.parse(model_path, field="model_path")
            model = str(self.checkpoints.sampler_model_dir(path, owner))
            base = self.checkpoints.run_record(path.model_id, owner)["base_model"]
        elif base_model:
            model = base = base_model
        else:
            raise BadRequest("model_path: give model_path or base_model", field="model_path")
        self.model_jobs.sub_job(session, owner, model)
        sampler = Sampler(
            uuid.uuid4().hex, owner, session.session_id, base, model=model, model_path=model_path
        )
        return self.state.add_sampler(sampler)

    def sample(self, body: bodies.SampleBody, owner: str | None) -> tuple[str, list[str]]:
        """Queue a sample; returns the request id and one sequence id per sample."""
        if body.sampling_session_id is not None:
            sampler = self.state.sampler(body.sampling_session_id, owner)
        else:
            raise BadRequest(
                "sampling_session_id: required (create a sampling session first)",
                field="sampling_session_id",
            )
        prompt = _prompt_tokens(body.prompt)
        params = _sampling_params(body)
        if body.topk_prompt_logprobs or body.topk_sample_logprobs:
            raise BadRequest(
                "topk_prompt_logprobs/topk_sample_logprobs: not supported here",
                field="topk_prompt_logprobs"
                if body.topk_prompt_logprobs
                else "topk_sample_logprobs",
            )
        # The on-prem generate limits, before anything is started: here without the engine
        # (its context is not known while it loads), again with it when the sample is queued.
        check_generate(self.service, None, SAMPLE_OP, [prompt], params)
        # Counted among the owner's unfinished ops until it ends (pending_work.py).
        release = self.service.pending.take(owner, payload_nbytes(prompt), self.service.limits)
        outer: Future = PendingWork.until(Future(), release)
        try:
            if sampler.sub_job_id is not None:
                sub_job_id = sampler.sub_job_id
            else:
                session = self.state.session(sampler.session_id, owner)
                sub_job_id = self.model_jobs.begin(session, owner, sampler.model)
                end = partial(self.model_jobs.end, owner, sampler.model, sub_job_id)
                outer.add_done_callback(lambda _: end())
            request_id = self._sample_on(sub_job_id, sampler, owner, prompt, params, body, outer)
        except BaseException as exc:
            outer.set_exception(exc)  # ends the sample's counts: its bytes, its use of the job
            raise
        return request_id, [f"{request_id}:{i}" for i in range(body.num_samples)]

    def _sample_on(self, sub_job_id, sampler, owner, prompt, params, body, outer) -> str:
        """Queue one sample on ``sub_job_id`` (waiting for its engine if it is still loading);
        returns its request id. A bad request is refused here, before it gets one."""
        want_prompt_logprobs = bool(body.prompt_logprobs)
        key, load = sub_job_id, None
        if sampler.snapshot is not None:
            key, load = self._snapshot_loader(sampler, owner)
        job_id = parent_of(sub_job_id)

        def attach() -> None:
            sub = self.service.resolve(sub_job_id, owner=owner)
            check_generate(self.service, sub.engine, SAMPLE_OP, [prompt], params)
            executor = self.service.executor
            submit = partial(executor.submit_runner, sub, OpName.GENERATE)
            joins = executor.overlaps(sub, OpName.GENERATE)
            done = self._batcher.add(
                sub, prompt, params, want_prompt_logprobs, submit, joins=joins, key=key, load=load
            )
            count = partial(self.service.metrics.add_tokens, OpName.GENERATE)
            done.add_done_callback(lambda f: _sample_result(f, outer, count))

        if self.service.get_job(job_id, owner=owner)["status"] == "running":
            attach()  # a bad request is refused here, before it gets a request id
        else:
            self._starts.then(job_id, owner, outer, attach)
        return self.futures.add(owner, outer)

    # -- ordering ---------------------------------------------------------------------------

    def refused(self, raw: Any, owner: str | None) -> None:
        """A training client's request refused before it was parsed (a field of the wrong
        type) still uses up its ``seq_id`` when the body names its run and an integer
        ``seq_id``, as a request refused by validation does (:meth:`_sequenced`)."""
        if not isinstance(raw, dict):
            return
        model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
        if not isinstance(model_id, str) or not _is_seq_id(seq_id):
            return
        with contextlib.suppress(ServiceError):  # not a run of this caller: nothing to unblock
            self.state.run(model_id, owner).sequencer.skip(seq_id)

    def _sequenced(
        self, run: TrainingRun, seq_id: int | None, owner, op: str, prepare, nbytes: int = 0
    ) -> str:
        """Validate with ``prepare()`` (which returns a :class:`Prepared`), then queue its runner
        on the run's trainer in ``seq_id`` order; returns its request id. A request refused by
        validation still uses up its ``seq_id``, so the client's later requests do not wait on
        it forever. Its ``nbytes`` (the body) count among the owner's unfinished ops from now
        until it ends, waiting for its turn included (``pending_work.py``), or from its
        validation on what the prepared request holds instead (``Prepared.nbytes``); one refused
        for either with 429 keeps its ``seq_id`` for the SDK's retry of the same request."""
        if seq_id is not None and not _is_seq_id(seq_id):
            # The SDK numbers a training client's requests from 1; it sends 0 only for a
            # caller's missing seq_id, which the Tinker service refuses the same way.
            raise BadRequest(
                f"seq_id: must be an integer >= {FIRST_SEQ_ID}, got {seq_id}", field="seq_id"
            )
        if seq_id is not None:
            known = run.sequencer.known(seq_id)
            if known is not None:
                return known
            run.sequencer.check_window(seq_id)
        limits = self.service.limits
        try:
            release = self.service.pending.take(owner, nbytes, limits)
        except PayloadTooLarge:  # never fits: refused for good, like a bad request
            if seq_id is not None:
                run.sequencer.skip(seq_id)
            raise
        try:
            prepared = prepare()
            if prepared.nbytes is not None:  # it holds what it built, no longer the body
                release()
                release = self.service.pending.take(owner, prepared.nbytes, limits)
        except BaseException as exc:
            release()
            refused_for_good = isinstance(exc, ServiceError) and not isinstance(
                exc, TooManyRequests
            )
            if seq_id is not None and refused_for_good:
                run.sequencer.skip(seq_id)
            raise
        runner = prepared.runner
        outer: Future = PendingWork.until(Future(), release)
        request_id = self.futures.add(owner, outer)

        def start() -> None:
            try:
                sub = self.service.resolve(run.training_sub_job, owner=owner)
                inner = self.service.executor.submit_runner(sub, op, lambda: runner(sub.engine))
            except Exception as exc:
                outer.set_exception(exc)
                return
            inner.add_done_callback(lambda f: _copy_outcome(f, outer))

        if seq_id is None:
            start()
        else:
            try:
                run.sequencer.admit(seq_id, request_id, start)
            except Conflict as exc:
                outer.set_exception(exc)
        return request_id


def _is_seq_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= FIRST_SEQ_ID


def _sample_result(done: Future, outer: Future, count_tokens: Callable[[int], None]) -> None:
    """The ``SampleResponse`` of a finished batched request (or its error); its sampled tokens
    counted as an on-prem ``generate`` counts them."""
    exc = failure_of(done)
    if exc is not None:
        outer.set_exception(exc)
        return
    outputs, scored = done.result()
    count_tokens(sum(len(o["token_ids"]) for o in outputs))
    sequences = [
        codec.SampledSequence(
            tokens=o["token_ids"],
            logprobs=[t["logprob"] for t in o["logprobs"]],
            stop_reason="stop" if o["finish_reason"] == "stop" else "length",
        )
        for o in outputs
    ]
    # what the cache provided for every sample (a request's samples may join in two admissions)
    cached = min((o.get("cached_prompt_tokens", 0) for o in outputs), default=0)
    body = codec.encode_sample_response(sequences, scored, cached)
    outer.set_result(OpResult(protobuf=body))


def _copy_outcome(source: Future, target: Future) -> None:
    exc = failure_of(source)
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def _prompt_tokens(model_input: bodies.ModelInput) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if chunk.type != "encoded_text":
            raise BadRequest(
                f"prompt.chunks[{i}]: {chunk.type} chunks are not supported",
                field=f"prompt.chunks[{i}]",
            )
        tokens.extend(chunk.tokens)
    if not tokens:
        raise BadRequest("prompt: no tokens", field="prompt")
    return tokens


def _sampling_params(body: bodies.SampleBody) -> dict:
    """Tinker ``SamplingParams`` as the sampler's vLLM-style dictionary (sampled-token
    log-probs always on: Tinker returns them with every sequence)."""
    p = body.sampling_params
    params: dict[str, Any] = {
        "n": body.num_samples,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "seed": p.seed,
        "logprobs": 0,
    }
    stop = p.stop
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif stop and all(isinstance(s, int) for s in stop):
        params["stop_token_ids"] = list(stop)
    elif stop:
        params["stop"] = list(stop)
    return params


def _experiment(model_id: str) -> str:
    """The experiment name of a training run's job (how a run of an earlier server finds it)."""
    return f"tinker {model_id}"
