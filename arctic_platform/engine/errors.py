"""Errors the engines raise for bad input.

Every engine validates what it is given before touching model or optimizer state, and reports the
offending field by name. The server maps the contract's :class:`FieldError` (of which
:class:`EngineInputError` is the engines' kind) to an HTTP 4xx; anything else an engine raises is a
failure of the job itself.
"""

from __future__ import annotations

from arctic_platform.contract.problems import FieldError


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
