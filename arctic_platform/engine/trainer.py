"""The training engine: what runs behind ``fwd_bwd``, ``fwd_no_grad``, ``step`` and checkpoints.

Semantics clients rely on:

* **Gradients accumulate** over ``forward_backward`` calls until ``step`` (as in Tinker), so a
  mini-batch may arrive in several calls. Each call's loss is its share of the objective over the
  *global* batch (``meta.batch_num_tokens`` / ``global_batch_size`` / ``dp_size``, see
  :mod:`arctic_platform.engine.losses.aggregation`), so the accumulated gradient is the same however
  the batch was split, into calls, microbatches or packed rows.
* **Validation first**: a request is parsed, checked and planned before any model, optimizer or
  gradient state changes; bad input raises :class:`EngineInputError` naming the field.
* **All or nothing**: a ``forward_backward`` stopped between microbatches (its request or job
  cancelled, see :mod:`arctic_platform.engine.cancellation`) adds no gradient at all.
* **step** applies AdamW with gradient clipping and the LR schedule. A non-finite gradient norm
  skips the update: gradients are dropped, weights, optimizer state and schedule are untouched,
  ``global_steps`` does not advance, and ``metrics["skipped"]`` is 1.
* **Determinism**: torch, Python and numpy generators are seeded from ``config.seed`` at
  construction; the same calls give bitwise-equal weights on CPU, and resuming from a checkpoint
  continues bit for bit.
* **Data parallelism** is a strategy the engine composes
  (:class:`~arctic_platform.engine.data_parallel.ParallelStrategy`): it wraps or shards the model,
  makes the ranks agree before any state changes, synchronises gradients, and gathers the full
  weights on rank 0 for checkpoints and weight streams. The default is one process; a rank of a
  data-parallel job returns None where only rank 0 answers (saves, weight streams) and accepts
  ``batch=None`` when it holds no rows of the request.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from arctic_platform.contract.bodies import learning_rate_problem
from arctic_platform.contract.problems import FieldError
from arctic_platform.contract.results import loss_fields
from arctic_platform.engine import cancellation
from arctic_platform.engine import checkpoint as ckpt
from arctic_platform.engine.checkpoint_layout import resolve_checkpoint
from arctic_platform.engine.chunked_head import LMHead
from arctic_platform.engine.config import TrainingEngineConfig
from arctic_platform.engine.data_parallel import ParallelStrategy
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.forward import (
    Request,
    forward_no_grad,
    prepare_training_request,
    scored_microbatches,
)
from arctic_platform.engine.host_memory import release_freed_heap
from arctic_platform.engine.meta import to_int
from arctic_platform.engine.metrics import MetricSums
from arctic_platform.engine.models import (
    MODEL_INIT_LOCK,
    apply_lora,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
)
from arctic_platform.engine.sampling_requests import model_context
from arctic_platform.engine.schedule import build_scheduler, lr_factor
from arctic_platform.engine.weights import (
    DEFAULT_CHUNK_BYTES,
    AdapterWeights,
    snapshot_adapters,
    stream_weights,
)

SLEEP_MODES = ("all",)


@dataclass(frozen=True)
class AdamSettings:
    """Per-step AdamW settings (Tinker's ``AdamParams`` minus the learning rate); ``grad_clip``
    0 means no clipping."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float


def seed_everything(seed: int) -> None:
    """Seed every generator model code may draw from (torch CPU and CUDA, Python, numpy)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


class TrainingEngine:
    """A trainable causal LM with its optimizer, schedule and checkpoints (see module doc)."""

    def __init__(
        self, config: TrainingEngineConfig, *, parallel: ParallelStrategy | None = None
    ) -> None:
        self.parallel = parallel if parallel is not None else ParallelStrategy()
        config = self.parallel.adapt_config(config)
        self.config = config
        self.device = resolve_device(config.model.device)
        # Settings that could not run here (a GPU-stack attention, LoRA on a tied output layer)
        # and what ran instead (setting -> what happened and why): the job lists them with its
        # ignored settings.
        self.setting_fallbacks: dict[str, str] = {}
        # Loading the weights draws no random numbers; seeding and the adapters' random
        # initialisation use process-global generators, so concurrent builds take turns there.
        model = load_causal_lm(
            config.model.model_copy(update={"lora": None}),
            self.device,
            fallbacks=self.setting_fallbacks,
        )
        with MODEL_INIT_LOCK:
            seed_everything(config.seed)
            if config.model.lora is not None:
                model = apply_lora(model, config.model.lora, self.setting_fallbacks)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = model.train()
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        # The longest row a request may hold (the model's context): longer ones are refused.
        self.max_model_len = model_context(model.config)
        # A long row is one microbatch: let a cancel stop it between transformer blocks too.
        cancellation.stop_before_blocks(model)
        # Found before any data-parallel wrapper; its hooks work through the wrappers' forward.
        self._head = LMHead.of(model, config.logits)
        # The module microbatches run through (the DDP wrapper, or the model sharded in place).
        self._module = self.parallel.attach(model, config.model, self.device)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        opt = config.optimizer
        # Fused: one pass per parameter and no parameter-sized temporaries (the for-each and
        # per-tensor forms allocate two for the square-root denominator, 1.2 GB for a 152 k x 1024
        # embedding, which made the step, not the forward, a real-vocabulary job's peak).
        self.optimizer = torch.optim.AdamW(
            self._trainable,
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            fused=True,
        )
        self.scheduler = build_scheduler(self.optimizer, config.scheduler)
        self.global_steps = 0
        self._lr_override: float | None = None
        self._offloaded = False

    # -- compute --------------------------------------------------------------------------

    def forward_backward(
        self,
        batch: Mapping | None,
        meta: Mapping | None = None,
        processing: Mapping | None = None,
        *,
        with_logprobs: bool = False,
    ) -> dict:
        """Add the gradient of the batch's loss; ``{"avg_loss", "loss", "metrics", "metric_sums"}``
        (and, ``with_logprobs``, the position-indexed ``[B, S]`` float32 ``logprobs`` the loss saw,
        as Tinker's ``forward_backward`` returns them).

        The loss defaults to ``verl_grpo`` (``cross_entropy`` for a batch with ``labels`` and no
        ``advantages``). ``metrics`` are global token means; ``metric_sums`` are the raw
        ``.sum``/``.tokens`` pairs a data-parallel layer reduces with
        :func:`arctic_platform.engine.metrics.reduce_metrics`. ``avg_loss`` and ``loss`` both equal
        ``metrics["loss"]``.
        """
        request, calls = self._prepare_agreed(batch, meta, processing, backward=True)
        self._wake_if_offloaded()
        self.model.train()
        sums = MetricSums()
        logprobs = None
        if request is not None:
            sums.add(request.sharing_metrics())
            if with_logprobs:
                logprobs = torch.zeros(request.batch.input_ids.shape)
        batches = self._microbatches(request, loss_positions_only=not with_logprobs)
        stopping = self.parallel.stopping(backward=True)
        with self._gradients_unchanged_unless_finished(), stopping as stop_point:
            for i in range(calls):
                stop_point(i)  # ranks of a process group stop together (data_parallel.py)
                with self.parallel.gradient_sync(last=i == calls - 1):
                    item = next(batches, None)  # the forward runs inside the sync context
                    if item is None:  # a busier rank has more microbatches
                        self.parallel.dummy_call(backward=True)
                        continue
                    mb, outputs, rows = item
                    self._backward(request, outputs, rows, sums)
                if logprobs is not None:
                    logprobs[mb.rows] = outputs["logprobs"].detach().float().cpu()
        if self.device.type == "cpu":
            release_freed_heap()  # before the optimizer's state lands on top (host_memory.py)
        answer = self._backward_answer(sums)
        if logprobs is not None:
            answer["logprobs"] = logprobs
        return answer

    def forward(
        self, batch: Mapping | None, meta: Mapping | None = None, processing: Mapping | None = None
    ) -> dict | None:
        """Position-indexed ``logprobs`` ``[B, S]`` float32 (+ ``entropy`` when asked), no grad.

        Entropy is computed when ``meta.calculate_entropy`` is true (the one knob; its older
        spellings are folded into it, :func:`arctic_platform.engine.meta.parse_request`). With a
        ``processing.loss_fn`` the loss's metrics and ``avg_loss`` are returned too (no
        gradient).
        """
        request, calls = self._prepare_agreed(batch, meta, processing, backward=False)
        self._wake_if_offloaded()
        with self.parallel.stopping(backward=False) as stop_point:
            stop_point(0)
            if request is None:
                self.parallel.pad_forward(calls)
                return None
            out = forward_no_grad(self.model, request, self.device, head=self._head)
            self.parallel.pad_forward(calls - len(request.plan))
        return out

    def step(self, learning_rate: float | None = None, *, adam: AdamSettings | None = None) -> dict:
        """One optimizer update from the accumulated gradients (see module doc).

        ``learning_rate`` replaces the peak learning rate for this and later steps (the schedule
        still scales it). ``adam`` replaces the AdamW betas, eps and weight decay for this and
        later steps, and the clipping norm for this step (Tinker sends them with every step).
        Returns ``grad_norm`` (before clipping), ``last_lr`` (the rate this update used),
        ``global_steps`` and ``metrics`` with the same plus ``skipped``.
        """
        problem = learning_rate_problem(learning_rate)
        if problem is not None:
            raise EngineInputError(problem.field, problem.message)
        self._wake_if_offloaded()
        if learning_rate is not None:
            self._set_peak_lr(learning_rate)
        clip = self.config.optimizer.grad_clip
        if adam is not None:
            for group in self.optimizer.param_groups:
                group.update(betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay)
            clip = adam.grad_clip
        lr = float(self.optimizer.param_groups[0]["lr"])
        norm = self.parallel.grad_norm(self._trainable)
        grad_norm = float(norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return self._step_result(grad_norm, lr, skipped=True)
        if clip > 0:
            self.parallel.clip_grads(self._trainable, clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_steps += 1
        return self._step_result(grad_norm, lr, skipped=False)

    # -- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(
        self,
        path: str | Path | None = None,
        *,
        step: int | None = None,
        export_hf: bool = False,
        save_total_limit: int | None = None,
    ) -> dict | None:
        """Save to ``<path>/checkpoint-<step>/`` (see :mod:`arctic_platform.engine.checkpoint`).

        ``path`` is the job folder, by default ``<checkpoint_dir>/<job_name>``; ``step`` defaults
        to ``global_steps``; ``save_total_limit`` to the config's. Returns ``{"path",
        "global_step", "checkpoint_id", "hf_path"}`` (None on the data-parallel ranks that do not
        write; with FSDP every rank must call, they gather the weights).
        """
        job_dir, step, save_total_limit = self._save_target(path, step, save_total_limit)
        full = self.parallel.full_state(self.model, self.optimizer)
        if full is None:
            return None
        model, optimizer = full
        return ckpt.save_checkpoint(
            job_dir,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=self.scheduler,
            trainer_state={"global_steps": self.global_steps, "lr_override": self._lr_override},
            tokenizer=self._tokenizer,
            export_hf=export_hf,
            save_total_limit=save_total_limit,
        )

    def load_checkpoint(
        self, path: str | Path | None = None, *, step: int | None = None, optimizer: bool = True
    ) -> dict:
        """Restore a checkpoint: ``path`` is a checkpoint folder or a job folder (default
        ``<checkpoint_dir>/<job_name>``), where ``step`` or else ``latest`` picks one.

        Accumulated gradients are dropped; with ``optimizer=False`` the AdamW moments start afresh
        (weights only, as Tinker's ``load_state``). Returns ``{"path", "global_step",
        "checkpoint_id"}``.
        """
        if step is not None:
            step = to_int("step", step, minimum=0)
        directory, problem = None, None
        if self.parallel.reads_checkpoints():
            try:
                directory = resolve_checkpoint(self._job_dir(path), step)
            except EngineInputError as exc:
                problem = exc
        directory, state = self.parallel.load_checkpoint(
            directory,
            problem,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
        )
        if not optimizer:
            self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps = int(state["global_steps"])
        self._lr_override = state.get("lr_override")
        return {
            "path": str(directory),
            "global_step": self.global_steps,
            "checkpoint_id": directory.name,
        }

    def weight_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes] | None:
        """The full weights as a safetensors chunk stream
        (:func:`~arctic_platform.engine.weights.stream_weights`); None on the data-parallel ranks
        other than 0 (with FSDP every rank must call, they gather the weights)."""
        model = self.parallel.export_model(self.model)
        return None if model is None else stream_weights(model, chunk_bytes)

    def sync_weights_to(self, target) -> dict:
        """Make ``target`` (a sampling engine in this process) hold this trainer's current
        weights, copied tensor by tensor (:func:`~arctic_platform.engine.weights.sync_in_process`);
        the load's report. A Ray trainer streams them to its replica instead."""
        from arctic_platform.engine import weights  # read at call time: tests hold the sync

        return weights.sync_in_process(self.model, target)

    def weight_snapshot(self) -> AdapterWeights:
        """Copies of the LoRA adapters now; loading merges them into the frozen base weights,
        which training does not change (:class:`~arctic_platform.engine.weights.AdapterWeights`)."""
        return AdapterWeights(self.model, snapshot_adapters(self.model))

    # -- colocation -----------------------------------------------------------------------

    def sleep(self, mode: str = "all") -> dict:
        """Offload weights, gradients and optimizer state to CPU memory (CUDA only).

        On a CPU engine there is nothing to offload and the answer says so. Idempotent; compute
        calls wake the engine on demand.
        """
        self.parallel.check_sleep(self.device)
        if mode not in SLEEP_MODES:
            raise EngineInputError("mode", f"unknown sleep mode {mode!r}; known: {SLEEP_MODES}")
        if self.device.type == "cpu":
            return {"offloaded": False, "reason": "model is on cpu"}
        if self._offloaded:
            return {"offloaded": True, "status": "already_offloaded"}
        moved = self._move_state(torch.device("cpu"))
        self._offloaded = True
        torch.cuda.empty_cache()
        return {"offloaded": True, "status": "offloaded", "bytes": moved}

    def wake(self) -> dict:
        """Bring offloaded state back to the device; idempotent."""
        if self.device.type == "cpu":
            return {"offloaded": False, "reason": "model is on cpu"}
        if not self._offloaded:
            return {"offloaded": False, "status": "already_on_device"}
        moved = self._move_state(self.device)
        self._offloaded = False
        return {"offloaded": False, "status": "reloaded", "bytes": moved}

    def empty_cache(self) -> dict:
        """Release cached allocator memory (CUDA) after a Python garbage collection."""
        gc.collect()
        if self.device.type != "cuda":
            return {"emptied": False, "reason": f"no allocator cache on {self.device.type}"}
        torch.cuda.empty_cache()
        return {"emptied": True}

    def close(self) -> None:
        """Nothing to release outside this process: the model goes with the engine."""

    # -- internals ------------------------------------------------------------------------

    def _prepare_agreed(
        self, batch: Mapping | None, meta, processing, *, backward: bool
    ) -> tuple[Request | None, int]:
        """Validate the request (None: a data-parallel rank without rows) and agree with the other
        ranks before anything changes: ``(request, model calls to make)``."""
        request, problem = None, None
        if batch is not None or self.parallel.world_size == 1:
            try:
                request = prepare_training_request(
                    batch, meta, processing, self.config, model=self, backward=backward
                )
            except FieldError as exc:  # the engine's checks and the contract's (processing)
                problem = exc
        return request, self.parallel.agree(problem, len(request.plan) if request else 0)

    def _microbatches(self, request: Request | None, *, loss_positions_only: bool) -> Iterator:
        """The scored microbatches of ``request`` through the strategy's module."""
        if request is None:
            return iter(())
        return scored_microbatches(
            self._module,
            request,
            self.device,
            head=self._head,
            loss_positions_only=loss_positions_only,
        )

    @staticmethod
    def _backward(request: Request, outputs: Mapping, rows: Mapping, sums: MetricSums) -> None:
        """Back-propagate one microbatch's share of the loss; add its metrics to ``sums``."""
        result = request.loss(outputs, rows)
        result.loss.backward()
        sums.add(result.metrics)

    @contextlib.contextmanager
    def _gradients_unchanged_unless_finished(self):
        """A ``forward_backward`` that stops part-way (its request cancelled between microbatches,
        or an error) leaves the accumulated gradients exactly as they were before the call: no
        half batch survives to the next ``step``. Costs a copy of the gradients only when some
        are already accumulated (the first call after a ``step`` starts from none)."""
        before = [None if p.grad is None else p.grad.clone() for p in self._trainable]
        try:
            yield
        except BaseException:
            for param, grad in zip(self._trainable, before, strict=True):
                param.grad = grad
            raise

    @staticmethod
    def _backward_answer(sums: MetricSums) -> dict:
        """What ``forward_backward`` returns for the microbatches ``sums`` holds."""
        metrics = sums.finalize()
        return {**loss_fields(metrics), "metrics": metrics, "metric_sums": sums.raw()}

    def _set_peak_lr(self, lr: float) -> None:
        self._lr_override = lr
        factor = lr_factor(self.config.scheduler, self.scheduler.last_epoch)
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = lr
            group["lr"] = lr * factor

    def _step_result(self, grad_norm: float, lr: float, *, skipped: bool) -> dict:
        metrics = {"grad_norm": grad_norm, "last_lr": lr, "skipped": int(skipped)}
        return {
            "grad_norm": grad_norm,
            "last_lr": lr,
            "global_steps": self.global_steps,
            "metrics": metrics,
        }

    def _save_target(
        self, path, step: int | None, save_total_limit: int | None
    ) -> tuple[Path, int, int | None]:
        """Validate a save's arguments: ``(job folder, step, retention)`` with the defaults.

        Retention deletes older ``checkpoint-<step>`` folders, so it applies only to the job's own
        checkpoint folder: a save elsewhere keeps every folder it finds there.
        """
        step = self.global_steps if step is None else to_int("step", step, minimum=0)
        job_dir = self._job_dir(path)
        own = path is None or (
            self.config.checkpoint_dir is not None
            and self._job_dir(None).resolve() == job_dir.resolve()
        )
        if save_total_limit is not None:
            save_total_limit = to_int("save_total_limit", save_total_limit, minimum=0)
            if save_total_limit and not own:
                raise EngineInputError(
                    "save_total_limit",
                    "retention applies only to the job's own checkpoint folder; "
                    "omit path or save_total_limit",
                )
        else:
            save_total_limit = self.config.save_total_limit if own else None
        return job_dir, step, save_total_limit

    def _job_dir(self, path) -> Path:
        if path is not None:
            return Path(path)
        if self.config.checkpoint_dir is None:
            raise EngineInputError("path", "no checkpoint folder: pass path or set checkpoint_dir")
        return Path(self.config.checkpoint_dir) / self.config.job_name

    @functools.cached_property
    def _tokenizer(self):
        """The model's tokenizer, saved beside checkpoints (loaded at the first save, once);
        None for a model without one."""
        try:
            return load_tokenizer(self.config.model)
        except (OSError, ValueError):
            return None

    def _wake_if_offloaded(self) -> None:
        if self._offloaded:
            self.wake()

    def _move_state(self, device: torch.device) -> int:
        """Move parameters, gradients and optimizer state to ``device``; return bytes moved."""
        moved = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)
                    moved += value.numel() * value.element_size()
        return moved
