"""Where a client-supplied path may point: the caller's own space, or folders the operator allows.

A shared server holds several tenants' checkpoints on one disk. Every path a client names (a save
or load ``path``, a ``model_name`` that is a local folder, a checkpoint behind
``source_checkpoint_info`` or an export) resolves, symlinks followed, inside the caller's tenant
folder ``<data-dir>/tenants/<owner>/``, or, for reading only, under a prefix the operator passed
with ``--allow-path`` (shared model folders), or, for saving and reading back, under a prefix the
operator passed with ``--allow-write-path``. Anything else is a 400 naming the field, raised before
any file is touched. Relative paths are taken relative to the tenant folder.

A server a user's own driver launches for itself (``launch_local_server``, the ray backend's state
actor) runs as that user and serves only that driver: it allows ``/`` both ways
(``server_identity.OWN_USER_PREFIXES``), so a framework's absolute checkpoint folder (SkyRL's
``trainer.ckpt_path``) means what it says, while relative paths still land in the data folder.

An in-process Service (``confine=False``) belongs to the one user whose process it runs in: there
paths mean what they mean to that user's program, and only the default layout applies.

Answers name paths the way the tenant may name them back (:meth:`PathPolicy.shown`): relative to
their space on a shared server, where the data folder's location is the operator's business, and
as they are on a server of the user's own. Error texts and job records shown to a tenant go
through :meth:`PathPolicy.redact` for the same reason.

Names and path parts a client chooses follow one rule (:func:`part_problem`, :func:`check_name`):
no control characters (NUL included), valid Unicode, at most :data:`NAME_MAX_BYTES` bytes a part
and :data:`CLIENT_PATH_MAX_BYTES` a path once resolved, so that a bad name is a 400 before
anything is queued rather than a filesystem error in the middle of a save.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from arctic_platform.engine.builtin import is_builtin, unknown_builtin_problem
from arctic_platform.server.errors import BadRequest

TENANTS_DIR = "tenants"
CHECKPOINTS_DIR = "checkpoints"
# The tenant of a server running without tokens (every caller is the same tenant then).
LOCAL_TENANT = "local"
# The longest path part (file or folder name) in UTF-8 bytes: NAME_MAX of ext4, xfs, btrfs, tmpfs.
NAME_MAX_BYTES = 255
# The longest path a system call takes (Linux's PATH_MAX), and the longest a client's path may be
# once resolved: room is left for what a save adds below it (a staging folder, an ``hf/`` export
# and a file in it).
PATH_MAX_BYTES = 4096
CLIENT_PATH_MAX_BYTES = PATH_MAX_BYTES - 3 * NAME_MAX_BYTES
# What a hub repository id looks like (``name`` or ``org/name``); only such names may skip the
# local-folder checks, and only when no such folder exists.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def part_problem(part: str, *, max_bytes: int = NAME_MAX_BYTES) -> str | None:
    """What is wrong with ``part`` as one component of a path (None: nothing)."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in part):
        return "holds a control character (NUL included)"
    try:
        size = len(part.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode text"
    if size > max_bytes:
        return f"has a part of {size} bytes; at most {max_bytes} are allowed"
    return None


def check_path_text(value: object, *, field: str) -> str:
    """``value`` if its every part can name a file (see module doc); else a 400 naming
    ``field``."""
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{field}: must be a non-empty path", field=field)
    problem = next(filter(None, map(part_problem, value.split("/"))), None)
    if problem is not None:
        raise BadRequest(f"{field}: the path {problem}", field=field)
    return value


def check_name(name: object, *, field: str, max_bytes: int = NAME_MAX_BYTES) -> str:
    """``name`` if it can name a checkpoint folder the server creates: one path part (no '/'),
    not hidden (names starting with '.' are the server's staging folders), and within
    ``max_bytes``; else a 400 naming ``field``."""
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{field}: a name is required", field=field)
    problem = part_problem(name, max_bytes=max_bytes)
    if problem is None and ("/" in name or name.startswith(".")):
        problem = "has a '/' or starts with '.'"
    if problem is not None:
        shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}..."
        raise BadRequest(f"{field}: {shown} is not a checkpoint name: it {problem}", field=field)
    return name


class PathPolicy:
    """Resolves client paths against the tenant folders and the operator's read-only prefixes."""

    def __init__(
        self,
        data_dir: Path,
        allowed_prefixes: Iterable[os.PathLike | str] = (),
        *,
        writable_prefixes: Iterable[os.PathLike | str] = (),
        confine: bool = True,
    ) -> None:
        self.root = Path(data_dir).resolve() / TENANTS_DIR
        self.writable_prefixes = tuple(Path(p).resolve() for p in writable_prefixes)
        # What may be saved may be loaded back.
        self.allowed = tuple(Path(p).resolve() for p in allowed_prefixes) + self.writable_prefixes
        self.confine = confine
        # Whether a tenant may see where the tenant folders are: on a server of the user's own
        # (unconfined, or '/' allowed) they are that user's own paths.
        self.reveals = not confine or any(self.root.is_relative_to(p) for p in self.allowed)
        self._data_dirs = sorted(
            {os.path.abspath(data_dir), str(Path(data_dir).resolve())}, key=len, reverse=True
        )

    def tenant_root(self, owner: str | None) -> Path:
        """The folder that holds everything of ``owner`` (created on first use)."""
        root = self.root / (owner or LOCAL_TENANT)
        root.mkdir(parents=True, exist_ok=True)
        return root

    def checkpoint_root(self, owner: str | None) -> Path:
        """Where jobs of ``owner`` save by default, one folder per sub-job."""
        return self.tenant_root(owner) / CHECKPOINTS_DIR

    def writable(self, owner: str | None, value: str, *, field: str) -> Path:
        """``value`` as a path inside the caller's tenant folder or a writable prefix; else a 400
        naming ``field``."""
        return self._checked(owner, value, self.writable_prefixes, "writable", field=field)

    def readable(self, owner: str | None, value: str, *, field: str) -> Path:
        """``value`` inside the caller's tenant folder or an allowed prefix; else a 400."""
        return self._checked(owner, value, self.allowed, "readable", field=field)

    def _checked(
        self, owner: str | None, value: str, prefixes: tuple[Path, ...], kind: str, *, field: str
    ) -> Path:
        """``value`` resolved, if inside the tenant folder or under one of ``prefixes``."""
        check_path_text(value, field=field)
        path = Path(value) if not self.confine else self._resolve(owner, value)
        size = len(os.path.abspath(path).encode("utf-8"))
        if size > CLIENT_PATH_MAX_BYTES:
            raise BadRequest(
                f"{field}: the path is {size} bytes long once resolved; at most "
                f"{CLIENT_PATH_MAX_BYTES} are allowed",
                field=field,
            )
        if not self.confine:
            return path
        if self._inside_tenant(owner, path) or any(path.is_relative_to(p) for p in prefixes):
            return path
        named = ", ".join(str(p) for p in prefixes) or "none configured"
        raise BadRequest(
            f"{field}: {self.redact(owner, value)!r} is outside your space and the "
            f"server's {kind} folders ({named}); give a path relative to your space",
            code="path_not_allowed",
            field=field,
        )

    def model_name(self, owner: str | None, name: str, *, field: str) -> str:
        """What to load for ``model_name``: a built-in (one that exists) or hub id as is, a local
        folder checked; a name no path could be (a part over 255 bytes, a NUL) is a 400 first.

        A relative name that exists in the tenant folder is that folder; a name that looks like a
        hub id and exists nowhere locally stays a hub id. Everything else is a local path and must
        be readable (see :meth:`readable`).
        """
        if is_builtin(name):
            problem = unknown_builtin_problem(name)
            if problem is not None:
                raise BadRequest(f"{field}: {problem}", field=field)
            return name
        if not self.confine:
            return name
        check_path_text(name, field=field)  # before any file is looked up by it
        if _HUB_ID.match(name) and ".." not in name:
            local = self.tenant_root(owner) / name
            if local.exists():
                return str(self.readable(owner, str(local), field=field))
            if not Path(name).exists():  # from_pretrained would read a cwd-relative folder
                return name
        local = self.readable(owner, name, field=field)
        if not local.exists():  # neither a hub id nor a folder: it would fail the job once built
            raise BadRequest(
                f"{field}: {self.redact(owner, name)!r} is no folder in your space or the "
                "server's allowed folders, and not a hub id ('name' or 'org/name')",
                field=field,
            )
        return str(local)

    def within(self, root: Path, files: Iterable[Path]) -> list[Path]:
        """The ``files`` whose real location is inside ``root`` (symlinks out are dropped)."""
        if not self.confine:
            return list(files)
        real_root = root.resolve()
        return [f for f in files if f.resolve().is_relative_to(real_root)]

    def shown(self, owner: str | None, path: str | os.PathLike) -> str:
        """How ``path`` is named in an answer to ``owner`` (see module doc): relative to their
        space when it lies there and the server hides its data folder, else as it is. A shown
        path loads back: relative paths are taken relative to the space."""
        if self.reveals:
            return str(path)
        root = self.tenant_root(owner).resolve()
        resolved = Path(path).resolve()
        if resolved.is_relative_to(root):
            return str(resolved.relative_to(root)) if resolved != root else "."
        return str(path)

    def redact(self, owner: str | None, text: str) -> str:
        """``text`` (an error, a job's reason or log line) with the data folder's location taken
        out where the server hides it: paths in ``owner``'s space become relative to it, any
        other mention of the data folder reads ``<data-dir>``."""
        if self.reveals:
            return text
        tenant = str(self.tenant_root(owner).resolve())
        text = text.replace(tenant + "/", "").replace(tenant, ".")
        for data_dir in self._data_dirs:
            text = text.replace(data_dir, "<data-dir>")
        return text

    def redact_all(self, owner: str | None, value: Any) -> Any:
        """:meth:`redact` applied to every string in a JSON-like ``value``."""
        if self.reveals:
            return value
        if isinstance(value, str):
            return self.redact(owner, value)
        if isinstance(value, dict):
            return {k: self.redact_all(owner, v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.redact_all(owner, v) for v in value]
        return value

    def _resolve(self, owner: str | None, value: str) -> Path:
        path = Path(value)
        if not path.is_absolute():
            path = self.tenant_root(owner) / path
        return path.resolve()  # follows symlinks, collapses ``..``

    def _inside_tenant(self, owner: str | None, path: Path) -> bool:
        return path.is_relative_to(self.tenant_root(owner).resolve())
