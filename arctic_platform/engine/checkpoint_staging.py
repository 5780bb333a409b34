"""Crash-safe publishing of checkpoint folders: stage, fsync, rename, fsync the parent.

A checkpoint is written into a hidden staging folder beside its final place and renamed into place
only when complete. A rename alone is not durable: after a power loss the folder may exist with
empty files, or the rename may be lost. So every staged file and the staging folder are fsynced
before the rename, and the parent folder after it. Staging folders of saves killed half-way
(``.tmp-checkpoint-*``, ``.old-checkpoint-*``) are removed by the next save into the folder and
by the server at start (:func:`remove_stale`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path

STAGING_PREFIXES = (".tmp-checkpoint-", ".old-checkpoint-")


def new_staging_dir(parent: Path, name: str) -> Path:
    """An empty hidden folder in ``parent`` where ``name`` is written before it is published."""
    staging = parent / f".tmp-{name}-{uuid.uuid4().hex}"
    staging.mkdir()  # not mkdtemp: the checkpoint keeps the umask's permissions, not 0700
    return staging


def publish(staging: Path, final: Path) -> None:
    """Make ``staging`` durable and rename it to ``final`` (an existing ``final`` is replaced)."""
    fsync_tree(staging)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        final.rename(old)
    staging.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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


def remove_stale(folders: Iterable[Path]) -> list[Path]:
    """Remove staging leftovers of killed saves directly inside ``folders``; what was removed."""
    removed = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.name.startswith(STAGING_PREFIXES) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed
