"""Errors the engines raise, and which of them leave an engine unusable.

Every engine validates what it is given before touching model or optimizer state, and reports the
offending field by name. The server maps the contract's :class:`FieldError` (of which
:class:`EngineInputError` is the engines' kind) to an HTTP 4xx. Anything else an engine raises
fails the request; it fails the job too when the op may have changed the engine's state part-way,
or when :func:`breaks_engine` says the engine cannot serve again (the executor's ``_guarded``).
"""

from __future__ import annotations

import sys

from arctic_platform.contract.problems import FieldError


class EngineBroken(RuntimeError):
    """The engine cannot run another op: its process or one of its workers died, or a
    data-parallel rank failed while its peers may wait for it. The job fails, whatever the op."""


def breaks_engine(error: BaseException) -> bool:
    """Whether ``error`` leaves the engine that raised it unusable: :class:`EngineBroken`, or a
    device fault (``torch.AcceleratorError``: a device-side assert, an illegal memory access),
    after which the device's context is lost; torch before 2.8 raises those as a
    ``RuntimeError`` whose message starts ``CUDA error``. Torch is looked up, not imported: an
    error from a process without torch cannot be a device fault."""
    if isinstance(error, EngineBroken):
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None:
        return isinstance(error, accelerator_error)
    return isinstance(error, RuntimeError) and str(error).startswith("CUDA error")


class EngineInputError(FieldError):
    """A malformed request to an engine; ``field`` names the culprit (e.g. ``batch.advantages``).

    A contract rule's :class:`FieldError` raised inside an engine (a bad sampling parameter) is
    bad input just the same: the server catches the base class."""


class CheckpointNotFound(EngineInputError):
    """A checkpoint a request names is not there, or not complete (files deleted since it was
    listed): the request is answered 404, nothing changed."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed on the filesystem (disk full, a name it refuses): the request
    fails, but the engine's state is untouched (a save only reads it), so the job goes on.

    The message carries the system's reason without the file name: that is a server path.
    """

    def __init__(self, errno: int | None, strerror: str) -> None:
        super().__init__(errno, strerror)

    @classmethod
    def of(cls, cause: OSError) -> CheckpointWriteError:
        return cls(cause.errno, cause.strerror or str(cause))

    def __str__(self) -> str:
        return f"could not write the checkpoint: {self.strerror}"


class PeerRejected(Exception):
    """Another data-parallel rank rejected its shard of this request; nothing changed here
    either."""


class SamplerStateError(RuntimeError):
    """The sampler cannot generate in its current state (its weights are partially loaded).

    Not bad input and not a broken job: a complete weight sync makes it usable again, so the
    server reports it as a conflict rather than failing the job.
    """


class UnsupportedModel(RuntimeError):
    """The model cannot run in our sampler: its modeling code does not pass attention keywords
    down to its attention function, which the shared-prefix decode step relies on
    (:mod:`arctic_platform.engine.shared_prefix`)."""
