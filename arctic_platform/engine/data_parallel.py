"""Data-parallel training as a strategy the trainer composes: one process, DDP or FSDP2.

:class:`~arctic_platform.engine.trainer.TrainingEngine` runs every request through a
:class:`ParallelStrategy`. The default, a plain :class:`ParallelStrategy`, is one process. With a
``torch.distributed`` process group, :func:`data_parallel_strategy` gives a :class:`DdpStrategy`
(replicas) or an :class:`FsdpStrategy` (each rank holds a shard of every parameter). Every rank
builds the same model from the same seed and receives a shard of each request's rows. What makes
N ranks equal one engine on the whole batch:

* **Losses** arrive with ``meta.dp_size`` and the *global* ``batch_num_tokens`` /
  ``global_batch_size`` (the Ray engine proxy fills them in), so each rank's loss is its share of
  the global objective times ``dp_size``; DDP and FSDP average gradients over ranks, which gives
  the gradient of the global objective (:mod:`arctic_platform.engine.losses.aggregation`).
* **Collectives line up.** DDP all-reduces on a backward and FSDP gathers parameters on every
  forward and backward, so every rank must run the same number of model calls. Before computing,
  the ranks agree (:meth:`ParallelStrategy.agree`, one small all-reduce) on whether every shard is
  valid and on the largest microbatch count; a rank with fewer microbatches (or no rows at all)
  runs zero-weight dummy calls to match. Gradients are only synchronised on the last call, so they
  accumulate locally first, and across ``forward_backward`` calls until ``step`` as on one engine.
* **Stopping together.** A rank never stops alone where the others would wait for it in a
  collective: a process group runs the microbatch loop under :func:`cancellation.deferred` and,
  before each model call (:meth:`ParallelStrategy.stopping`), the ranks agree (one small
  all-reduce) whether any was asked to stop; then all stop at that call and the trainer puts
  their gradients back, which holds because gradients are only synchronised on the last call.
  FSDP keeps unsynchronised gradients inside its own state and gathers on every forward, so its
  ``forward_backward`` and ``forward`` agree only before their first call. A DDP ``forward`` has
  no collective, so each rank stops on its own there.
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

With one rank there is no process group and the strategy is the plain
:class:`ParallelStrategy`, so a one-worker job is bit-for-bit the in-process engine.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from arctic_platform.engine import cancellation
from arctic_platform.engine import checkpoint as ckpt
from arctic_platform.engine.config import ModelConfig, TrainingEngineConfig
from arctic_platform.engine.errors import EngineInputError, PeerRejected
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.weights import load_into_model

StrategyName = Literal["ddp", "fsdp"]
STRATEGIES: tuple[StrategyName, ...] = ("ddp", "fsdp")
# What a checkpoint is written from: the full model and an optimizer (or its gathered state).
_FullState = tuple[torch.nn.Module, object]
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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


def data_parallel_strategy(name: str, *, rank: int, world_size: int) -> ParallelStrategy:
    """The strategy for rank ``rank`` of ``world_size`` (the process group already joined when
    ``world_size > 1``); one rank is the plain :class:`ParallelStrategy` whatever ``name`` says."""
    if name not in STRATEGIES:
        raise EngineInputError(
            "training_config.data_parallel", f"unknown strategy {name!r}; one of ddp, fsdp"
        )
    if world_size == 1:
        return ParallelStrategy()
    cls = DdpStrategy if name == "ddp" else FsdpStrategy
    return cls(rank=rank, world_size=world_size)


class ParallelStrategy:
    """What the trainer asks of its data-parallel layer; this class answers for one process
    without a process group (the plain engine), its subclasses for a rank of a group.

    The trainer calls :meth:`attach` once, then, per request, :meth:`agree` on every rank before
    computing and :meth:`gradient_sync` / :meth:`dummy_call` around its microbatches.
    """

    def __init__(self, *, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.module: torch.nn.Module | None = None

    def adapt_config(self, config: TrainingEngineConfig) -> TrainingEngineConfig:
        """The engine config this strategy can run (it may turn features off)."""
        return config

    def attach(
        self, model: torch.nn.Module, model_config: ModelConfig, device: torch.device
    ) -> torch.nn.Module:
        """Take charge of ``model`` (before the optimizer is built on its parameters); return the
        module microbatches run through."""
        self.device = device
        self.module = model
        return model

    def agree(self, problem: Exception | None, microbatches: int) -> int:
        """All ranks: raise if any rank's request is bad; else the model calls each rank makes."""
        if problem is not None:
            raise problem
        return microbatches

    def gradient_sync(self, last: bool) -> AbstractContextManager:
        """The context a backward runs in: gradients are synchronised on the ``last`` call."""
        return contextlib.nullcontext()

    def stopping(self, *, backward: bool) -> AbstractContextManager[Callable[[int], None]]:
        """The context a request's model calls run in; it yields ``stop_point(i)``, called before
        call ``i``, which raises :class:`~arctic_platform.engine.cancellation.OpCancelled` where
        this rank stops. One process stops at the engine's own checks between microbatches."""
        return contextlib.nullcontext(_never)

    def dummy_call(self, *, backward: bool) -> None:
        """A one-token model call whose loss weighs zero: a busier rank's collectives without a
        contribution (one process agrees on its own count and never needs it)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        logits = self.module(input_ids=ids, position_ids=ids, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def pad_forward(self, calls: int) -> None:
        """Match a busier rank's no-grad forward calls (only sharded parameters need it)."""

    def grad_norm(self, params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
        """The total 2-norm of the model's accumulated gradients (0 without any)."""
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def clip_grads(
        self, params: Sequence[torch.nn.Parameter], max_norm: float, norm: torch.Tensor
    ) -> None:
        """Scale the gradients so their total norm (``norm``) is at most ``max_norm``."""
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)

    def full_state(self, model: torch.nn.Module, optimizer) -> _FullState | None:
        """All ranks: the full ``(model, optimizer)`` a checkpoint is written from, on the rank
        that writes it; None on the others."""
        return model, optimizer

    def export_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """All ranks: the full model weights are streamed from, on rank 0; None elsewhere."""
        return model

    def reads_checkpoints(self) -> bool:
        """Whether this rank resolves and reads checkpoint folders on load."""
        return True

    def load_checkpoint(
        self,
        directory: Path | None,
        problem: Exception | None,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
    ) -> tuple[Path, dict]:
        """All ranks: restore ``directory`` (resolved on the ranks that read checkpoints;
        ``problem`` is why it could not be) into the live state; ``(folder, trainer state)``."""
        self.agree(problem, 0)
        assert directory is not None
        state = ckpt.load_checkpoint(
            directory, model=model, optimizer=optimizer, scheduler=scheduler
        )
        return directory, state

    def check_sleep(self, device: torch.device) -> None:
        """Refuse offloading when this strategy cannot offload on ``device``."""


class _ProcessGroup(ParallelStrategy):
    """A rank of ``world_size`` in the default process group."""

    def agree(self, problem: Exception | None, microbatches: int) -> int:
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

    # Whether every call of a request can stop (else only before the first); whether a no-grad
    # forward has collectives. See module doc, "Stopping together".
    stops_between_calls = True
    gathers_on_forward = False

    @contextlib.contextmanager
    def stopping(self, *, backward: bool) -> Iterator[Callable[[int], None]]:
        if not backward and not self.gathers_on_forward:
            yield _never  # no collective: each rank stops at the engine's own checks
            return
        every_call = backward and self.stops_between_calls
        with cancellation.deferred() as requested:
            yield (
                lambda call: self._agree_to_go_on(requested()) if every_call or call == 0 else None
            )

    def _agree_to_go_on(self, reason: str | None) -> None:
        """All ranks: stop together (:class:`OpCancelled` everywhere) if any rank was asked to."""
        flag = torch.tensor([int(reason is not None)], dtype=torch.int64)
        if self.device.type == "cuda":
            flag = flag.to(self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]):
            raise cancellation.OpCancelled(
                reason or "another data-parallel rank of this op was stopped"
            )


class DdpStrategy(_ProcessGroup):
    """Replicas: ``DistributedDataParallel`` averages gradients on the last backward."""

    def attach(
        self, model: torch.nn.Module, model_config: ModelConfig, device: torch.device
    ) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        self.device = device
        device_ids = [device.index or 0] if device.type == "cuda" else None
        # Buffers (rotary frequencies) are identical by construction; syncing them on every
        # forward would add a collective that the ranks' differing call counts could not match.
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        )
        self.module = DistributedDataParallel(model, device_ids=device_ids, **{no_sync: False})
        return self.module

    def gradient_sync(self, last: bool) -> AbstractContextManager:
        return contextlib.nullcontext() if last else self.module.no_sync()

    def full_state(self, model: torch.nn.Module, optimizer) -> _FullState | None:
        return (model, optimizer) if self.rank == 0 else None

    def export_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return model if self.rank == 0 else None


class FsdpStrategy(_ProcessGroup):
    """Shards: FSDP2 (``fully_shard``) on each transformer block, then the root."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        super().__init__(rank=rank, world_size=world_size)
        self._model_config: ModelConfig | None = None
        self._mirror: torch.nn.Module | None = None

    def adapt_config(self, config: TrainingEngineConfig) -> TrainingEngineConfig:
        # FSDP gathers parameters on every forward; the ranks' model calls must match one for
        # one, and a shared-prompt microbatch makes two where a dummy call makes one.
        return config.model_copy(update={"prompt_sharing": "off"})

    def attach(
        self, model: torch.nn.Module, model_config: ModelConfig, device: torch.device
    ) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        if ckpt.is_lora(model):
            raise EngineInputError(
                "training_config.data_parallel",
                "fsdp does not support LoRA adapters; use data_parallel ddp",
            )
        self.device = device
        self._model_config = model_config
        blocks = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(model)
        self.module = model
        return model

    def gradient_sync(self, last: bool) -> AbstractContextManager:
        self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    stops_between_calls = False  # unsynchronised gradients live inside FSDP's own state
    gathers_on_forward = True

    def pad_forward(self, calls: int) -> None:
        # Sharded parameters are gathered on every forward: match the busiest rank's count.
        with torch.no_grad():
            for _ in range(calls):
                self.dummy_call(backward=False)

    def grad_norm(self, params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
        """The whole model's gradient norm, the same on every rank (see module doc)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in _local_grads(params):
            squares += grad.float().pow(2).sum()
        dist.all_reduce(squares)
        return squares.sqrt()

    def clip_grads(
        self, params: Sequence[torch.nn.Parameter], max_norm: float, norm: torch.Tensor
    ) -> None:
        coef = min(max_norm / (float(norm) + 1e-6), 1.0)
        for grad in _local_grads(params):
            grad.mul_(coef)

    def full_state(self, model: torch.nn.Module, optimizer) -> _FullState | None:
        mirror = self._gather_into_mirror(model)
        full = _FullOptimizerState(optimizer, self._gather_optimizer_state(optimizer))
        return None if mirror is None else (mirror, full)

    def export_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return self._gather_into_mirror(model)

    def reads_checkpoints(self) -> bool:
        return self.rank == 0

    def check_sleep(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise EngineInputError(
                "mode", "sleep-training is not supported with data_parallel fsdp; use ddp"
            )

    def _gather_into_mirror(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """All ranks: gather each sharded tensor; rank 0 copies them into its plain CPU model."""
        from torch.distributed.tensor import DTensor

        full: dict[str, torch.Tensor] = {}
        for name, value in model.state_dict().items():
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            if self.rank == 0:
                full[name] = tensor.detach().to("cpu")
        if self.rank != 0:
            return None
        mirror = self._mirror_model(model)
        load_into_model(mirror, full)
        return mirror

    def _mirror_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Rank 0's plain CPU copy of the model (built once), the unit checkpoints and weight
        streams are made of."""
        if self._mirror is None:
            dtype = next(model.parameters()).dtype
            # It holds weights and never runs attention: no GPU-stack attention to try on CPU.
            config = self._model_config.model_copy(
                update={
                    "device": "cpu",
                    "dtype": _DTYPE_NAMES.get(dtype, "auto"),
                    "attn_implementation": None,
                }
            )
            self._mirror = load_causal_lm(config, torch.device("cpu"))
        return self._mirror

    def _gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """All ranks: the optimizer state with every shard gathered; the dict on rank 0 only."""
        from torch.distributed.tensor import DTensor

        state = optimizer.state_dict()
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

    def load_checkpoint(
        self,
        directory: Path | None,
        problem: Exception | None,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
    ) -> tuple[Path, dict]:
        """Rank 0 reads the checkpoint into its plain model; every rank takes its shard."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        full_optimizer = None
        shared: list = [None]
        if self.rank == 0 and problem is None:
            holder = _FullOptimizerState(optimizer, None)
            try:
                mirror = self._mirror_model(model)
                trainer_state = ckpt.load_checkpoint(
                    directory, model=mirror, optimizer=holder, scheduler=scheduler
                )
            except EngineInputError as exc:
                problem = exc
            else:
                full_optimizer = holder.loaded
                shared = [
                    (
                        str(directory),
                        trainer_state,
                        scheduler.state_dict(),
                        _structure(full_optimizer),
                        ckpt.capture_rng(),
                    )
                ]
        self.agree(problem, 0)
        dist.broadcast_object_list(shared, src=0)
        where, trainer_state, scheduler_state, structure, rng = shared[0]

        def scatter(source: torch.Tensor | None, like: DTensor, shape, dtype) -> DTensor:
            if source is None:  # ranks other than 0 receive their shard
                source = torch.empty(shape, dtype=dtype)
            source = source.to(self.device, dtype)
            return distribute_tensor(source, like.device_mesh, like.placements)

        mirror_state = self._mirror.state_dict() if self.rank == 0 else {}
        with torch.no_grad():
            for name, live in model.state_dict().items():
                shard = scatter(mirror_state.get(name), live, live.shape, live.dtype)
                live.to_local().copy_(shard.to_local())
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer_state: dict = {"state": {}, "param_groups": structure["param_groups"]}
        for index, entry in structure["state"].items():
            param = params[index]
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
        optimizer.load_state_dict(optimizer_state)
        if self.rank != 0:
            scheduler.load_state_dict(scheduler_state)
            ckpt.restore_rng(rng)
        return Path(where), trainer_state


def _never(call: int) -> None:
    """A stop point that never stops (the engine's own checks decide)."""


def _local_grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """This rank's shards of the accumulated gradients (views: scaling them scales those)."""
    return [p.grad.to_local() for p in params if p.grad is not None]


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
