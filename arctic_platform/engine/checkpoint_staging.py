"""Crash-safe publishing of checkpoint folders: stage, fsync, swap by rename, then delete the old.

Every saver publishes through here: the trainer's ``checkpoint-<step>`` folders (with their HF
export) and the Tinker API's named checkpoints (training state, sampler and external weights). A
folder is written into a hidden staging folder beside its final place and renamed into place only
when complete. A rename alone is not durable: after a power loss the folder may exist with empty
files, or the rename may be lost. So every staged file and the staging folder are fsynced before
the rename, and the parent folder after it.

Overwriting an existing folder keeps the old version until the new one is in place: the old
folder is renamed aside (``.old-<name>-<tag>``), the staged one renamed to ``<name>``, the parent
fsynced, and only then is the old one deleted. A process killed at any point leaves ``<name>``
complete (old or new) or, between the two renames, only the old one aside; :func:`recover` (run
by the next save into the folder and by the server at start) puts it back and removes what a
killed save left half-written (``.tmp-<name>-<tag>``). So a reader never finds a half-written
checkpoint under its name, and an acknowledged save is never lost.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from arctic_platform.engine.errors import CheckpointWriteError

_STAGING, _RETIRED = ".tmp-", ".old-"
# A staging or retired folder: ``.tmp-<name>-<tag>`` / ``.old-<name>-<tag>`` (the tag is a uuid's
# hex; folders of older versions carry a process id).
_LEFTOVER = re.compile(r"^\.(tmp|old)-(?P<name>.+)-[0-9a-f]+$")
# How many bytes the staging and retired names add to a published folder's name: a name may be
# at most a filesystem's name limit less this.
NAME_OVERHEAD = len(_RETIRED) + 1 + len(uuid.uuid4().hex)


def new_staging_dir(parent: Path, name: str) -> Path:
    """An empty hidden folder in ``parent`` where ``name`` is written before it is published."""
    staging = parent / f"{_STAGING}{name}-{uuid.uuid4().hex}"
    staging.mkdir()  # not mkdtemp: the checkpoint keeps the umask's permissions, not 0700
    return staging


def publish(staging: Path, final: Path) -> None:
    """Make ``staging`` durable and rename it to ``final``; an existing ``final`` is replaced
    only once the new version is in place (see module doc)."""
    fsync_tree(staging)
    retired = None
    if final.exists():
        retired = final.with_name(f"{_RETIRED}{final.name}-{uuid.uuid4().hex}")
        final.rename(retired)
    staging.rename(final)
    fsync_dir(final.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def staged(
    final: Path, *, publisher: Callable[[Path, Path], object] | None = None
) -> Iterator[Path]:
    """A staging folder for ``final`` (its parent created), published when the body ends (by
    ``publisher(staging, final)``, which calls :func:`publish`: a caller records the checkpoint
    in the same step there); on an error it is removed and ``final`` is as it was. An
    ``OSError`` (disk full, a name the filesystem refuses) is raised as
    :class:`CheckpointWriteError`."""
    with writing():
        final.parent.mkdir(parents=True, exist_ok=True)
        recover([final.parent])
        staging = new_staging_dir(final.parent, final.name)
        try:
            yield staging
            (publisher or publish)(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """Raise a filesystem error of the body as :class:`CheckpointWriteError`: the request that
    saves fails, the job that holds the model does not (nothing of its state changed)."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except OSError as exc:
        raise CheckpointWriteError.of(exc) from exc


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees the old or the new content, durably."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder, deepest first."""
    folders = [root]
    for entry in sorted(root.rglob("*")):
        if entry.is_symlink():
            continue
        if entry.is_dir():
            folders.append(entry)
        elif entry.is_file():
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    """fsync a folder's entries (where the platform allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on folders
            os.fsync(fd)
    finally:
        os.close(fd)


def is_leftover(name: str) -> bool:
    """Whether ``name`` is a staging or retired folder's (never a published checkpoint's)."""
    return _LEFTOVER.match(name) is not None


def recover(folders: Iterable[Path]) -> list[Path]:
    """Undo what killed saves left directly inside ``folders``: a retired version whose
    replacement never arrived is renamed back, everything else staged or retired is removed.
    Returns the folders removed or restored."""
    touched = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            match = _LEFTOVER.match(entry.name)
            if match is None or not entry.is_dir() or entry.is_symlink():
                continue
            final = folder / match["name"]
            if match[1] == "old" and not final.exists():
                entry.rename(final)
                fsync_dir(folder)
            else:
                shutil.rmtree(entry, ignore_errors=True)
            touched.append(entry)
    return touched


def remove_published(final: Path) -> None:
    """Remove a published folder: renamed to a staging name first (one atomic step, so no reader
    finds it half-deleted, and a crash leaves a leftover :func:`recover` removes), then deleted."""
    if not final.exists():
        return
    doomed = final.with_name(f"{_STAGING}{final.name}-{uuid.uuid4().hex}")
    final.rename(doomed)
    fsync_dir(final.parent)
    shutil.rmtree(doomed, ignore_errors=True)
