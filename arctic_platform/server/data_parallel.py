"""The trainer one Ray training worker hosts: a TrainingEngine replicated (DDP) or sharded (FSDP2)
across a ``torch.distributed`` process group.

Every rank builds the same model from the same seed and receives a shard of each request's rows.
What makes N ranks equal one engine on the whole batch:

* **Losses** arrive with ``meta.dp_size`` and the *global* ``batch_num_tokens`` /
  ``global_batch_size`` (the Ray engine proxy fills them in), so each rank's loss is its share of
  the global objective times ``dp_size``; DDP and FSDP average gradients over ranks, which gives
  the gradient of the global objective (:mod:`arctic_platform.engine.losses.aggregation`).
* **Collectives line up.** DDP all-reduces on a backward and FSDP gathers parameters on every
  forward and backward, so every rank must run the same number of model calls. Before computing,
  the ranks agree (one small all-reduce) on whether every shard is valid and on the largest
  microbatch count; a rank with fewer microbatches (or no rows at all) runs zero-weight dummy
  calls to match. Gradients are only synchronised on the last call, so they accumulate locally
  first, and across ``forward_backward`` calls until ``step`` as on one engine.
* **Stopping together.** A rank never stops alone (the others would wait for it in the next
  collective): the microbatch loop runs under :func:`cancellation.deferred` and, before each
  model call, the ranks agree (one small all-reduce) whether any was asked to stop; then all
  stop at that call and put their gradients back as they were, which holds because gradients
  are only synchronised on the last call. FSDP keeps unsynchronised gradients inside its own
  state, so a sharded ``forward_backward`` (and ``forward``) agrees only before its first call.
* **Validation first.** A shard that fails validation makes every rank reject the request before
  any state changes (the rejecting rank raises its :class:`EngineInputError`, the others
  :class:`PeerRejected`).
* **step**: with DDP the synchronised gradients are identical on every rank, so each rank's norm
  is the global one; with FSDP each rank holds a shard, so the norm is the square root of the
  all-reduced sum of the shards' squares.
* **Checkpoints and weight export**: DDP rank 0 writes and exports its own replica. FSDP ranks
  gather the full weights (and optimizer state) into a plain CPU model on rank 0, which writes the
  same on-disk format as one engine and streams weights to samplers. Loading happens on every rank
  (DDP: each rank reads the checkpoint, so it must be on storage all nodes see; FSDP: rank 0 reads
  it and scatters each rank's shard).

With one rank there is no process group and every method is the plain TrainingEngine's, so a
one-worker job is bit-for-bit the in-process engine.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from arctic_platform.engine import cancellation
from arctic_platform.engine import checkpoint as ckpt
from arctic_platform.engine.config import TrainingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.forward import Request, forward_no_grad
from arctic_platform.engine.forward import scored_microbatches as _scored
from arctic_platform.engine.meta import to_int
from arctic_platform.engine.metrics import MetricSums
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.schedule import build_scheduler
from arctic_platform.engine.trainer import TrainingEngine
from arctic_platform.engine.weights import DEFAULT_CHUNK_BYTES, load_into_model, stream_weights

Strategy = Literal["ddp", "fsdp"]
STRATEGIES: tuple[Strategy, ...] = ("ddp", "fsdp")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class PeerRejected(Exception):
    """Another rank rejected its shard of this request; nothing changed here either."""


def open_rendezvous(host: str, world_size: int, *, timeout_s: float) -> dist.TCPStore:
    """Rank 0: the process group's key-value store, listening on a port the OS picks.

    Binding port 0 inside the store (rather than probing for a free port and binding it later)
    leaves no window in which another process, or another job's rank 0, can take the port, which
    would make the ranks of one job meet in different stores and wait forever.
    """
    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    timeout_s: float,
    store: dist.TCPStore | None = None,
) -> str:
    """Join the group of ``world_size`` ranks meeting at rank 0's store ``master_addr:master_port``
    (rank 0 passes the ``store`` it opened with :func:`open_rendezvous`).

    NCCL when this process sees a CUDA device, gloo otherwise. Returns the backend name.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray exposes exactly the worker's GPU as device 0
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_addr, master_port, world_size, is_master=False, timeout=timeout
        )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return backend


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class DataParallelEngine(TrainingEngine):
    """One rank of a data-parallel training job (see module doc)."""

    def __init__(
        self, config: TrainingEngineConfig, *, strategy: Strategy, rank: int, world_size: int
    ) -> None:
        if strategy not in STRATEGIES:
            raise EngineInputError(
                "training_config.data_parallel", f"unknown strategy {strategy!r}; one of ddp, fsdp"
            )
        if strategy == "fsdp" and world_size > 1:
            # FSDP gathers parameters on every forward; the ranks' model calls must match one
            # for one, and a shared-prompt microbatch makes two where a dummy call makes one.
            config = config.model_copy(update={"prompt_sharing": "off"})
        super().__init__(config)
        self.strategy = strategy
        self.rank = rank
        self.world_size = world_size
        self._ddp = None
        self._mirror: torch.nn.Module | None = None
        if world_size == 1:
            return
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index or 0] if self.device.type == "cuda" else None
            # Buffers (rotary frequencies) are identical by construction; syncing them on every
            # forward would add a collective that the ranks' differing call counts could not match.
            params = inspect.signature(DistributedDataParallel).parameters
            no_sync = (
                "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
            )
            self._ddp = DistributedDataParallel(
                self.model, device_ids=device_ids, **{no_sync: False}
            )
        else:
            self._shard()

    # -- compute --------------------------------------------------------------------------

    def forward_backward(
        self, batch: Mapping | None, meta: Mapping | None = None, processing: Mapping | None = None
    ) -> dict:
        """This rank's share of the gradient; ``batch=None`` for a rank without rows.

        Returns what :meth:`TrainingEngine.forward_backward` returns, for this rank's rows.
        """
        if self.world_size == 1:
            return super().forward_backward(batch, meta, processing)
        request, calls = self._prepare_shard(batch, meta, processing, backward=True)
        self._wake_if_offloaded()
        self.model.train()
        sums = MetricSums()
        if request is not None:
            sums.add(request.sharing_metrics())
        batches = self._microbatches(request)
        with self._gradients_unchanged_unless_finished(), cancellation.deferred() as requested:
            for i in range(calls):
                if i == 0 or not self._sharded:
                    self._agree_to_go_on(requested())
                with self._gradient_sync(i == calls - 1):
                    item = next(batches, None)  # the forward runs inside the sync context
                    if item is None:
                        self._dummy_call(backward=True)
                        continue
                    _, outputs, rows = item
                    self._backward(request, outputs, rows, sums)
        return self._backward_answer(sums)

    def forward(
        self, batch: Mapping | None, meta: Mapping | None = None, processing: Mapping | None = None
    ) -> dict | None:
        """Log-probs of this rank's rows (None for a rank without rows), no gradient."""
        if self.world_size == 1:
            return super().forward(batch, meta, processing)
        request, calls = self._prepare_shard(batch, meta, processing, backward=False)
        self._wake_if_offloaded()
        if not self._sharded:  # no collectives: each rank may stop on its own
            return forward_no_grad(self.model, request, self.device) if request else None
        # Sharded parameters are gathered on every forward: every rank makes the busiest rank's
        # number of calls, so none stops part-way (see :meth:`forward_backward`).
        with cancellation.deferred() as requested:
            self._agree_to_go_on(requested())
            out = forward_no_grad(self.model, request, self.device) if request else None
            with torch.no_grad():
                for _ in range(calls - (len(request.plan) if request else 0)):
                    self._dummy_call(backward=False)
        return out

    # -- checkpoints and weights ----------------------------------------------------------

    def save_checkpoint(
        self,
        path: str | Path | None = None,
        *,
        step: int | None = None,
        export_hf: bool = False,
        save_total_limit: int | None = None,
    ) -> dict | None:
        """Rank 0 writes the checkpoint and returns its record; other ranks return None.

        With DDP only rank 0 needs to be called; with FSDP every rank must call (they gather).
        """
        if not self._sharded:
            if self.rank != 0:
                return None
            return super().save_checkpoint(
                path, step=step, export_hf=export_hf, save_total_limit=save_total_limit
            )
        job_dir, step, save_total_limit = self._save_target(path, step, save_total_limit)
        mirror = self._gather_into_mirror()
        optimizer = _FullOptimizerState(self.optimizer, self._gather_optimizer_state())
        if self.rank != 0:
            return None
        return self._write_checkpoint(
            job_dir,
            step,
            mirror,
            optimizer,
            export_hf=export_hf,
            save_total_limit=save_total_limit,
        )

    def load_checkpoint(self, path: str | Path | None = None, *, step: int | None = None) -> dict:
        """Restore a checkpoint on every rank; all ranks agree it loads before any changes."""
        if self.world_size == 1:
            return super().load_checkpoint(path, step=step)
        if step is not None:
            step = to_int("step", step, minimum=0)
        directory, problem = None, None
        if self.strategy == "ddp" or self.rank == 0:
            try:
                directory = ckpt.resolve_checkpoint(self._job_dir(path), step)
            except EngineInputError as exc:
                problem = exc
        if self.strategy == "ddp":
            self._agree(problem, 0)
            return super().load_checkpoint(directory)
        return self._load_sharded(directory, problem)

    def weight_chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes] | None:
        """Rank 0: the full weights as a safetensors chunk stream; other ranks: None.

        With DDP only rank 0 needs to be called; with FSDP every rank must call (they gather).
        """
        model = self._gather_into_mirror() if self._sharded else self.model
        return stream_weights(model, chunk_bytes) if self.rank == 0 else None

    def sleep(self, mode: str = "all") -> dict:
        if self._sharded and self.device.type != "cpu":
            raise EngineInputError(
                "mode", "sleep-training is not supported with data_parallel fsdp; use ddp"
            )
        return super().sleep(mode)

    # -- internals ------------------------------------------------------------------------

    @property
    def _sharded(self) -> bool:
        """FSDP over several ranks: each rank holds only a shard of every parameter."""
        return self.strategy == "fsdp" and self.world_size > 1

    def _grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm, the same on every rank (see module doc)."""
        if not self._sharded:
            return super()._grad_norm()
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in self._local_grads():
            squares += grad.float().pow(2).sum()
        dist.all_reduce(squares)
        return squares.sqrt()

    def _clip_grads(self, max_norm: float, norm: torch.Tensor) -> None:
        if not self._sharded:
            return super()._clip_grads(max_norm, norm)
        coef = min(max_norm / (float(norm) + 1e-6), 1.0)
        for grad in self._local_grads():
            grad.mul_(coef)

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's shards of the accumulated gradients (views: scaling them scales those)."""
        return [p.grad.to_local() for p in self._trainable if p.grad is not None]

    def _shard(self) -> None:
        """FSDP2: shard each transformer block, then the root; rebuild the optimizer on shards."""
        from torch.distributed.fsdp import fully_shard

        if ckpt.is_lora(self.model):
            raise EngineInputError(
                "training_config.data_parallel",
                "fsdp does not support LoRA adapters; use data_parallel ddp",
            )
        blocks = set(getattr(self.model, "_no_split_modules", None) or ())
        for module in self.model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(self.model)
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        opt = self.config.optimizer
        self.optimizer = torch.optim.AdamW(
            self._trainable, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.scheduler = build_scheduler(self.optimizer, self.config.scheduler)

    def _prepare_shard(
        self, batch: Mapping | None, meta, processing, *, backward: bool
    ) -> tuple[Request | None, int]:
        """All ranks: validate this rank's shard (None: no rows) and agree with the others;
        ``(request, model calls every rank makes)`` (see :meth:`_agree`)."""
        request, problem = None, None
        if batch is not None:
            try:
                request = self._prepare(batch, meta, processing, backward=backward)
            except EngineInputError as exc:
                problem = exc
        return request, self._agree(problem, len(request.plan) if request else 0)

    def _agree(self, problem: Exception | None, microbatches: int) -> int:
        """All ranks: reject together if any shard is bad; else the largest microbatch count."""
        flags = torch.tensor([int(problem is not None), microbatches], dtype=torch.int64)
        if self.device.type == "cuda":
            flags = flags.to(self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if int(flags[0]):
            if problem is not None:
                raise problem
            raise PeerRejected("another data-parallel rank rejected its shard of this request")
        return max(int(flags[1]), 1)

    def _agree_to_go_on(self, reason: str | None) -> None:
        """All ranks: stop together (:class:`OpCancelled` everywhere) if any rank's op was asked
        to stop; a rank that stopped alone would leave the others waiting in a collective."""
        flag = torch.tensor([int(reason is not None)], dtype=torch.int64)
        if self.device.type == "cuda":
            flag = flag.to(self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]):
            raise cancellation.OpCancelled(
                reason or "another data-parallel rank of this op was stopped"
            )

    def _microbatches(self, request: Request | None):
        if request is None:
            return iter(())
        module = self._ddp if self._ddp is not None else self.model
        return _scored(module, request, self.device)

    def _gradient_sync(self, last: bool):
        if self._ddp is not None:
            return contextlib.nullcontext() if last else self._ddp.no_sync()
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _dummy_call(self, *, backward: bool) -> None:
        """A one-token model call whose loss weighs zero: collectives without a contribution."""
        module = self._ddp if self._ddp is not None else self.model
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        logits = module(input_ids=ids, position_ids=ids, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _gather_into_mirror(self) -> torch.nn.Module | None:
        """All ranks: gather each sharded tensor; rank 0 copies them into its plain CPU model."""
        from torch.distributed.tensor import DTensor

        full: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict().items():
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            if self.rank == 0:
                full[name] = tensor.detach().to("cpu")
        if self.rank != 0:
            return None
        mirror = self._mirror_model()
        load_into_model(mirror, full)
        return mirror

    def _mirror_model(self) -> torch.nn.Module:
        """Rank 0's plain CPU copy of the model (built once), the unit checkpoints and weight
        streams are made of."""
        if self._mirror is None:
            dtype = next(self.model.parameters()).dtype
            config = self.config.model.model_copy(
                update={"device": "cpu", "dtype": _DTYPE_NAMES.get(dtype, "auto")}
            )
            self._mirror = load_causal_lm(config, torch.device("cpu"))
        return self._mirror

    def _gather_optimizer_state(self) -> dict | None:
        """All ranks: the optimizer state with every shard gathered; the dict on rank 0 only."""
        from torch.distributed.tensor import DTensor

        state = self.optimizer.state_dict()
        gathered: dict[int, dict] = {}
        for index in sorted(state["state"]):
            entry = {}
            for key in sorted(state["state"][index]):
                value = state["state"][index][key]
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                entry[key] = value.detach().to("cpu") if isinstance(value, torch.Tensor) else value
            gathered[index] = entry
        if self.rank != 0:
            return None
        return {"state": gathered, "param_groups": state["param_groups"]}

    def _load_sharded(self, directory: Path | None, problem: Exception | None) -> dict:
        """FSDP: rank 0 reads the checkpoint into its plain model; every rank takes its shard."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        full_optimizer = None
        shared: list = [None]
        if self.rank == 0 and problem is None:
            holder = _FullOptimizerState(self.optimizer, None)
            try:
                mirror = self._mirror_model()
                trainer_state = ckpt.load_checkpoint(
                    directory, model=mirror, optimizer=holder, scheduler=self.scheduler
                )
            except EngineInputError as exc:
                problem = exc
            else:
                full_optimizer = holder.loaded
                shared = [
                    (
                        str(directory),
                        trainer_state,
                        self.scheduler.state_dict(),
                        _structure(full_optimizer),
                        ckpt.capture_rng(),
                    )
                ]
        self._agree(problem, 0)
        dist.broadcast_object_list(shared, src=0)
        where, trainer_state, scheduler_state, structure, rng = shared[0]

        def scatter(source: torch.Tensor | None, like: DTensor, shape, dtype) -> DTensor:
            if source is None:  # ranks other than 0 receive their shard
                source = torch.empty(shape, dtype=dtype)
            source = source.to(self.device, dtype)
            return distribute_tensor(source, like.device_mesh, like.placements)

        mirror_state = self._mirror.state_dict() if self.rank == 0 else {}
        with torch.no_grad():
            for name, live in self.model.state_dict().items():
                shard = scatter(mirror_state.get(name), live, live.shape, live.dtype)
                live.to_local().copy_(shard.to_local())
        optimizer_state: dict = {"state": {}, "param_groups": structure["param_groups"]}
        for index, entry in structure["state"].items():
            param = self._trainable[index]
            restored = {}
            for key, spec in entry.items():
                if not isinstance(spec, tuple):
                    restored[key] = spec
                    continue
                shape, dtype = spec
                source = full_optimizer["state"][index][key] if self.rank == 0 else None
                if tuple(shape) == tuple(param.shape):
                    restored[key] = scatter(source, param, shape, dtype)
                else:  # a scalar such as AdamW's step count: the same on every rank
                    value = source if source is not None else torch.empty(shape, dtype=dtype)
                    value = value.to(self.device)
                    dist.broadcast(value, src=0)
                    restored[key] = value
            optimizer_state["state"][index] = restored
        self.optimizer.load_state_dict(optimizer_state)
        if self.rank != 0:
            self.scheduler.load_state_dict(scheduler_state)
            ckpt.restore_rng(rng)
        return self._loaded(Path(where), trainer_state)


class _FullOptimizerState:
    """Stands in for a sharded optimizer where the checkpoint code wants a full one.

    Saving reads :meth:`state_dict` (the gathered state); loading checks ``param_groups`` against
    the live optimizer and keeps what :meth:`load_state_dict` receives in :attr:`loaded`.
    """

    def __init__(self, live: torch.optim.Optimizer, full_state: dict | None) -> None:
        self.param_groups = live.param_groups
        self._full = full_state
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        assert self._full is not None
        return self._full

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def _structure(optimizer_state: dict | None) -> dict | None:
    """The optimizer state with each tensor replaced by ``(shape, dtype)``, for broadcasting."""
    if optimizer_state is None:
        return None
    return {
        "param_groups": optimizer_state["param_groups"],
        "state": {
            index: {
                key: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                for key, v in entry.items()
            }
            for index, entry in optimizer_state["state"].items()
        },
    }
