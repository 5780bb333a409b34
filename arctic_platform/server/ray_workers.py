"""The Ray actors that run engines: one training rank, or one sampling / log-prob replica.

The classes are plain; :mod:`arctic_platform.server.ray_engines` turns them into actors with
``ray.remote`` and the placement's resources. Conventions on both sides of the actor boundary:

* **Tensors cross as numpy arrays** (zero-copy through the object store; torch tensors would be
  pickled, 10-100x slower). Arrays that arrive are read-only views of shared memory, so they are
  copied before torch sees them.
* **Bad input is a value, not an exception.** A :class:`FieldError`, a sampler state error
  or a peer rank's rejection comes back as :class:`Rejected`, which the proxy turns back into the
  exception the Service maps to 400/409. Anything raised is a failure of the worker, which fails
  the job (and a dead actor surfaces as ``RayActorError``).
* Construction does nothing heavy; ``start`` builds the engine, so a failure to build is an
  ordinary error reply rather than an actor that died in its constructor.
* **One generic relay.** ``call(method, *args, op_id=, **kwargs)`` runs ``engine.<method>`` for
  any method of the engine Protocol of the worker's kind (``contract/engine_protocols.py``),
  except those the proxy does itself (``RELAYED``): a method added to a Protocol reaches the
  actors with no copy of it here. Only what is not an engine call has its own actor method
  (starting, a training rank's rendezvous and weight export, loading a weight stream).
* **Stopping an op in flight.** An op that can stop (``forward_backward``, ``forward``, a
  replica's ``generate``, ...) gets an ``op_id`` from the proxy and runs inside
  :func:`arctic_platform.engine.cancellation.scope` with that op's token (without an id it runs
  to its end); the proxy stops it with ``stop_op(op_id, reason)``, which the actor runs in its
  ``control`` concurrency group (its own thread) while the op's thread keeps the default group.
  The op answers :class:`Stopped`.
  ``ray.cancel`` is not used: it would also drop a data-parallel rank's op that had not started
  yet (leaving the other ranks waiting in a collective) and replaces the reply of an op that
  finished anyway with ``TaskCancelledError``, hiding a gradient that was added.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from arctic_platform.contract.engine_protocols import ENGINE_PROTOCOLS, protocol_methods
from arctic_platform.contract.problems import FieldError
from arctic_platform.engine import cancellation
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.engine.errors import (
    CheckpointNotFound,
    CheckpointWriteError,
    PeerRejected,
    SamplerStateError,
)
from arctic_platform.tensor_tree import to_object_store

# The actors' concurrency groups: ops run one at a time in the default group, ``stop_op`` in this.
CONCURRENCY_GROUPS = {"control": 1}
# The Protocol methods the proxy does itself: closing kills the actors; a weight snapshot or sync
# travels through the object store (``weight_chunks``, ``load_weight_chunks``).
PROXY_OWN = frozenset({"close", "sync_weights_to", "weight_snapshot"})
RELAYED: dict[str, frozenset[str]] = {
    kind: protocol_methods(protocol) - PROXY_OWN for kind, protocol in ENGINE_PROTOCOLS.items()
}


@dataclass(frozen=True)
class Rejected:
    """A request refused without any state change: ``kind`` is ``input`` (bad input, naming
    ``field``), ``missing`` (the checkpoint it names is not there), ``write`` (the filesystem
    refused a checkpoint, ``errno`` says why), ``state`` (the sampler cannot serve right now) or
    ``peer`` (another rank refused its shard)."""

    kind: Literal["input", "missing", "write", "state", "peer"]
    field: str
    message: str
    errno: int | None = None


@dataclass(frozen=True)
class Stopped:
    """An op stopped part-way at the proxy's request (see module doc), leaving no state change."""

    reason: str


class OpStops:
    """The stop tokens of one actor's ops, by op id. A stop may arrive before its op starts (the
    op then stops at its first check) or after it ended: beyond :data:`KEEP` such tokens of ops
    not running, the oldest is dropped; a running op's token never is (a replica runs many at
    once)."""

    KEEP = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, CancelToken] = {}
        self._running: set[str] = set()

    def token(self, op_id: str, *, running: bool = False) -> CancelToken:
        """``op_id``'s token (made on first use); ``running``: the op starts now."""
        with self._lock:
            if running:
                self._running.add(op_id)
            token = self._tokens.get(op_id)
            if token is None:
                token = self._tokens[op_id] = CancelToken()
                idle = [i for i in self._tokens if i not in self._running]
                for stale in idle[: max(0, len(idle) - self.KEEP)]:
                    del self._tokens[stale]
            return token

    def stop(self, op_id: str, reason: str) -> None:
        self.token(op_id).cancel(reason)

    def done(self, op_id: str) -> None:
        with self._lock:
            self._tokens.pop(op_id, None)
            self._running.discard(op_id)


def _replying(fn: Callable[[], Any], stops: OpStops | None = None, op_id: str | None = None) -> Any:
    """``fn()`` with results as numpy, refusals as :class:`Rejected` and, when ``op_id`` names a
    stoppable op, a stop as :class:`Stopped` (see module doc)."""
    tokens = () if op_id is None or stops is None else (stops.token(op_id, running=True),)
    try:
        with cancellation.scope(*tokens):
            return to_object_store(fn())
    except cancellation.OpCancelled as exc:
        return Stopped(exc.reason)
    except CheckpointNotFound as exc:
        return Rejected("missing", exc.field, exc.message)
    except FieldError as exc:
        return Rejected("input", exc.field, exc.message)
    except CheckpointWriteError as exc:
        return Rejected("write", "path", exc.strerror, exc.errno)
    except SamplerStateError as exc:
        return Rejected("state", "", str(exc))
    except PeerRejected as exc:
        return Rejected("peer", "", str(exc))
    finally:
        if op_id is not None and stops is not None:
            stops.done(op_id)


class _EngineWorker:
    """What both actor classes share: the engine, the relay of its Protocol's methods and the
    stop tokens of their calls (``stop_op``)."""

    kind: str

    def __init__(self) -> None:
        self.engine: Any = None
        self.stops = OpStops()

    def call(self, method: str, *args: Any, op_id: str | None = None, **kwargs: Any) -> Any:
        """``engine.<method>(*args, **kwargs)`` for a method of this kind's Protocol; with an
        ``op_id``, stoppable through :meth:`stop_op`."""
        if method not in RELAYED[self.kind]:
            raise AttributeError(f"a {self.kind} engine has no relayed method {method!r}")
        target = getattr(self.engine, method)
        args, kwargs = _writable(args), _writable(kwargs)
        return _replying(lambda: target(*args, **kwargs), self.stops, op_id)

    def stop_op(self, op_id: str, reason: str) -> None:
        """Stop the op ``op_id`` at its next check (called in the ``control`` group)."""
        self.stops.stop(op_id, reason)


class TrainingWorker(_EngineWorker):
    """One rank of a data-parallel training job: a ``TrainingEngine`` composed with the rank's
    :mod:`~arctic_platform.engine.data_parallel` strategy."""

    kind = "training"

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank = rank
        self.world_size = world_size
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
        """Join the process group and build the engine; ``{vocab_size, setting_fallbacks,
        backend, pid}``."""
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
            return {
                "vocab_size": self.engine.vocab_size,
                "setting_fallbacks": self.engine.setting_fallbacks,
                "max_model_len": self.engine.max_model_len,
                "backend": backend,
                "pid": os.getpid(),
            }

        return _replying(build)

    def weight_chunks(self, chunk_bytes: int) -> Any:
        """Rank 0: object refs of the weight stream's chunks, put one at a time; others: None."""
        import ray

        def export() -> list | None:
            chunks = self.engine.weight_chunks(chunk_bytes)
            return None if chunks is None else [ray.put(chunk) for chunk in chunks]

        return _replying(export)

    def stop(self) -> None:
        """Leave the process group so the rank exits cleanly (the actor is killed after)."""
        from arctic_platform.engine.data_parallel import leave_process_group

        self.engine = None
        leave_process_group()
        self.store = None


class InferenceWorker(_EngineWorker):
    """A sampling replica (a ``SamplingEngine``) or a log-prob replica (a ``LogProbEngine``)."""

    def __init__(self, kind: Literal["sampling", "log_prob"]) -> None:
        super().__init__()
        self.kind = kind

    def start(self, config) -> Any:
        def build() -> dict:
            if self.kind == "sampling":
                from arctic_platform.engine.sampling_backends import build_sampling_engine

                self.engine = build_sampling_engine(config)
            else:
                from arctic_platform.engine.logprob_engine import LogProbEngine

                self.engine = LogProbEngine(config)
            return {
                "vocab_size": self.engine.vocab_size,
                "max_model_len": self.engine.max_model_len,
                "pid": os.getpid(),
                "concurrent_generate": self.kind == "sampling" and self.engine.concurrent_generate,
            }

        return _replying(build)

    def load_weight_chunks(self, refs: list) -> Any:
        """Load a weight stream whose chunks sit in the object store, fetching one at a time."""
        import ray

        from arctic_platform.engine.weights import iter_weights_from_chunks

        chunks = (ray.get(ref) for ref in refs)
        return _replying(lambda: self.engine.load_weights(iter_weights_from_chunks(chunks)))


def _writable(value: Any) -> Any:
    """Copies of read-only arrays (object-store views), recursively through dicts and tuples."""
    if isinstance(value, np.ndarray) and not value.flags.writeable:
        return value.copy()
    if isinstance(value, Mapping):
        return {k: _writable(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_writable(v) for v in value)
    return value
