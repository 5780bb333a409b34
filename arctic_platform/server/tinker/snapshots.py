"""Sampler snapshots: a trainer's weights at one ``save_weights_and_get_sampling_client``.

Tinker's sampling client samples the weights it was created with, whatever the training client
does next; a run's sampling sub-job holds one set of weights, so it loads a snapshot's before it
samples for it (:mod:`.operations`). What a snapshot keeps depends on where the trainer's model
lives:

* **In this process** (:class:`AdapterSnapshot`): copies of its LoRA adapters (small,
  :func:`~arctic_platform.engine.weights.snapshot_adapters`); loading exports the trainer's
  frozen base weights merged with the snapshot's adapters.
* **In Ray workers** (``serve --ray``, :class:`ChunkSnapshot`): the model cannot be read from
  here, so the snapshot is taken where it lives: rank 0 puts the merged weight stream's chunks
  in Ray's object store (the export a weight sync streams), and loading hands their refs to the
  sampling replica, which fetches them one at a time. Each kept snapshot holds one model's
  merged weights in the object store (Ray spills them to disk past its memory) until the run
  drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AdapterSnapshot:
    """An in-process trainer's LoRA adapters at snapshot time."""

    adapters: Any

    def load_into(self, sampler, trainer) -> None:
        from arctic_platform.engine.weights import export_weights

        # the trainer's base weights are frozen, so reading them beside its training is safe
        sampler.load_weights(export_weights(trainer.model, adapters=self.adapters))


@dataclass(frozen=True)
class ChunkSnapshot:
    """Object-store refs of a Ray trainer's merged weight chunks at snapshot time."""

    refs: list

    def load_into(self, sampler, trainer) -> None:
        sampler.load_weight_chunks(self.refs)


def take_snapshot(trainer) -> AdapterSnapshot | ChunkSnapshot:
    """The trainer engine's weights now, kept as its kind of engine allows (module doc)."""
    chunk_refs = getattr(trainer, "weight_chunk_refs", None)
    if chunk_refs is not None:
        return ChunkSnapshot(chunk_refs())
    from arctic_platform.engine.weights import snapshot_adapters

    return AdapterSnapshot(snapshot_adapters(trainer.model))
