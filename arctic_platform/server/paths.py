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
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from arctic_platform.engine.builtin import is_builtin
from arctic_platform.server.errors import BadRequest

TENANTS_DIR = "tenants"
CHECKPOINTS_DIR = "checkpoints"
# The tenant of a server running without tokens (every caller is the same tenant then).
LOCAL_TENANT = "local"
# What a hub repository id looks like (``name`` or ``org/name``); only such names may skip the
# local-folder checks, and only when no such folder exists.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


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
        if not self.confine:
            return Path(value)
        path = self._resolve(owner, value, field=field)
        if self._inside_tenant(owner, path) or any(path.is_relative_to(p) for p in prefixes):
            return path
        named = ", ".join(str(p) for p in prefixes) or "none configured"
        raise BadRequest(
            f"{field}: {value!r} is outside your space ({self.tenant_root(owner)}) and the "
            f"server's {kind} folders ({named}); give a path relative to your space",
            code="path_not_allowed",
            field=field,
        )

    def model_name(self, owner: str | None, name: str, *, field: str) -> str:
        """What to load for ``model_name``: a built-in or hub id as is, a local folder checked.

        A relative name that exists in the tenant folder is that folder; a name that looks like a
        hub id and exists nowhere locally stays a hub id. Everything else is a local path and must
        be readable (see :meth:`readable`).
        """
        if is_builtin(name) or not self.confine:
            return name
        if _HUB_ID.match(name) and ".." not in name:
            local = self.tenant_root(owner) / name
            if local.exists():
                return str(self.readable(owner, str(local), field=field))
            if not Path(name).exists():  # from_pretrained would read a cwd-relative folder
                return name
        return str(self.readable(owner, name, field=field))

    def within(self, root: Path, files: Iterable[Path]) -> list[Path]:
        """The ``files`` whose real location is inside ``root`` (symlinks out are dropped)."""
        if not self.confine:
            return list(files)
        real_root = root.resolve()
        return [f for f in files if f.resolve().is_relative_to(real_root)]

    def _resolve(self, owner: str | None, value: str, *, field: str) -> Path:
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            raise BadRequest(f"{field}: must be a non-empty path", field=field)
        path = Path(value)
        if not path.is_absolute():
            path = self.tenant_root(owner) / path
        return path.resolve()  # follows symlinks, collapses ``..``

    def _inside_tenant(self, owner: str | None, path: Path) -> bool:
        return path.is_relative_to(self.tenant_root(owner).resolve())
