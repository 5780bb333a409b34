"""The Ray actors that run engines: one training rank, or one sampling / log-prob replica.

The classes are plain; :mod:`arctic_platform.server.ray_engines` turns them into actors with
``ray.remote`` and the placement's resources. Conventions on both sides of the actor boundary:

* **Tensors cross as numpy arrays** (zero-copy through the object store; torch tensors would be
  pickled, 10-100x slower). Arrays that arrive are read-only views of shared memory, so they are
  copied before torch sees them.
* **Bad input is a value, not an exception.** An :class:`EngineInputError`, a sampler state error
  or a peer rank's rejection comes back as :class:`Rejected`, which the proxy turns back into the
  exception the Service maps to 400/409. Anything raised is a failure of the worker, which fails
  the job (and a dead actor surfaces as ``RayActorError``).
* Construction does nothing heavy; ``start`` builds the engine, so a failure to build is an
  ordinary error reply rather than an actor that died in its constructor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from arctic_platform.engine.errors import EngineInputError, PeerRejected, SamplerStateError
from arctic_platform.tensor_tree import to_object_store


@dataclass(frozen=True)
class Rejected:
    """A request refused without any state change: ``kind`` is ``input`` (bad input, naming
    ``field``), ``state`` (the sampler cannot serve right now) or ``peer`` (another rank refused
    its shard)."""

    kind: Literal["input", "state", "peer"]
    field: str
    message: str


def _replying(fn: Callable[[], Any]) -> Any:
    """``fn()`` with results as numpy and refusals as :class:`Rejected` (see module doc)."""
    try:
        return to_object_store(fn())
    except EngineInputError as exc:
        return Rejected("input", exc.field, exc.message)
    except SamplerStateError as exc:
        return Rejected("state", "", str(exc))
    except PeerRejected as exc:
        return Rejected("peer", "", str(exc))


class TrainingWorker:
    """One rank of a data-parallel training job: a ``TrainingEngine`` composed with the rank's
    :mod:`~arctic_platform.engine.data_parallel` strategy."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.engine = None
        self.store = None  # rank 0's rendezvous store (see ``rendezvous``)

    def rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: open the process group's store; its address and port for the other ranks."""
        import ray

        from arctic_platform.engine.data_parallel import open_rendezvous

        host = ray.util.get_node_ip_address()
        self.store = open_rendezvous(host, self.world_size, timeout_s=timeout_s)
        return host, self.store.port

    def start(
        self, config, strategy: str, master_addr: str, master_port: int, timeout_s: float
    ) -> Any:
        """Join the process group and build the engine; ``{vocab_size, backend, pid}``."""
        from arctic_platform.engine.data_parallel import data_parallel_strategy, join_process_group
        from arctic_platform.engine.trainer import TrainingEngine

        def build() -> dict:
            backend = None
            parallel = data_parallel_strategy(strategy, rank=self.rank, world_size=self.world_size)
            if self.world_size > 1:
                backend = join_process_group(
                    self.rank,
                    self.world_size,
                    master_addr,
                    master_port,
                    timeout_s=timeout_s,
                    store=self.store,
                )
            self.engine = TrainingEngine(config, parallel=parallel)
            return {"vocab_size": self.engine.vocab_size, "backend": backend, "pid": os.getpid()}

        return _replying(build)

    def forward_backward(self, batch: Mapping | None, meta: Mapping, processing: Mapping) -> Any:
        return _replying(lambda: self.engine.forward_backward(_writable(batch), meta, processing))

    def forward(self, batch: Mapping | None, meta: Mapping, processing: Mapping) -> Any:
        return _replying(lambda: self.engine.forward(_writable(batch), meta, processing))

    def step(self, learning_rate: float | None) -> Any:
        return _replying(lambda: self.engine.step(learning_rate))

    def save_checkpoint(self, path, step, export_hf: bool, save_total_limit) -> Any:
        return _replying(
            lambda: self.engine.save_checkpoint(
                path, step=step, export_hf=export_hf, save_total_limit=save_total_limit
            )
        )

    def load_checkpoint(self, path, step) -> Any:
        return _replying(lambda: self.engine.load_checkpoint(path, step=step))

    def weight_chunks(self, chunk_bytes: int) -> Any:
        """Rank 0: object refs of the weight stream's chunks, put one at a time; others: None."""
        import ray

        def export() -> list | None:
            chunks = self.engine.weight_chunks(chunk_bytes)
            return None if chunks is None else [ray.put(chunk) for chunk in chunks]

        return _replying(export)

    def sleep(self, mode: str) -> Any:
        return _replying(lambda: self.engine.sleep(mode))

    def wake(self) -> Any:
        return _replying(self.engine.wake)

    def empty_cache(self) -> Any:
        return _replying(self.engine.empty_cache)

    def stop(self) -> None:
        """Leave the process group so the rank exits cleanly (the actor is killed after)."""
        from arctic_platform.engine.data_parallel import leave_process_group

        self.engine = None
        leave_process_group()
        self.store = None


class InferenceWorker:
    """A sampling replica (a ``SamplingEngine``) or a log-prob replica (a ``LogProbEngine``)."""

    METHODS: ClassVar[dict[str, frozenset[str]]] = {
        "sampling": frozenset({"generate", "sleep", "wake", "reset_prefix_cache"}),
        "log_prob": frozenset({"forward", "log_probs"}),
    }

    def __init__(self, kind: Literal["sampling", "log_prob"]) -> None:
        self.kind = kind
        self.engine = None

    def start(self, config) -> Any:
        def build() -> dict:
            if self.kind == "sampling":
                from arctic_platform.engine.sampling_backends import build_sampling_engine

                self.engine = build_sampling_engine(config)
            else:
                from arctic_platform.engine.logprob_engine import LogProbEngine

                self.engine = LogProbEngine(config)
            return {"pid": os.getpid()}

        return _replying(build)

    def call(self, method: str, *args: Any) -> Any:
        """``engine.<method>(*args)`` for the methods the ops use on this kind of engine."""
        if method not in self.METHODS[self.kind]:
            raise AttributeError(f"a {self.kind} replica has no method {method!r}")
        target = getattr(self.engine, method)
        return _replying(lambda: target(*(_writable(a) for a in args)))

    def load_weight_chunks(self, refs: list) -> Any:
        """Load a weight stream whose chunks sit in the object store, fetching one at a time."""
        import ray

        from arctic_platform.engine.weights import iter_weights_from_chunks

        chunks = (ray.get(ref) for ref in refs)
        return _replying(lambda: self.engine.load_weights(iter_weights_from_chunks(chunks)))


def _writable(value: Any) -> Any:
    """Copies of read-only arrays (object-store views), recursively through dicts."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()
    if isinstance(value, Mapping):
        return {k: _writable(v) for k, v in value.items()}
    return value
