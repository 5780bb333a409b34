"""The one checkpoint catalogue: which checkpoints each job saved, and where.

Every save is recorded here, whichever API asked for it: the on-prem and Cortex ``save`` op and
the Tinker API's named saves (``tinker/checkpoints.py``, under ids ``<kind>-<name>``), so each is
listed, downloaded, deleted and expired the same way, through any surface. Records live in the
metadata store (``store.py``), so a restarted server still lists them and can start a new job
from one; a record is served only while its folder exists and only to its job's owner
(``PathPolicy``). A record may carry an expiry (Tinker's TTL): once past it, the checkpoint is
deleted the next time its job's checkpoints are looked at. At start the catalogue also tidies
what earlier servers left: checkpoints of the layout before tenant folders, and saves a killed
process did not finish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from arctic_platform.contract.job_config import SubJobConfig
from arctic_platform.engine.checkpoint_layout import is_loadable
from arctic_platform.engine.checkpoint_staging import publish as publish_folder
from arctic_platform.engine.checkpoint_staging import recover, remove_published
from arctic_platform.server.errors import BadRequest, NotFound
from arctic_platform.server.job_registry import JobRegistry, SubJob
from arctic_platform.server.paths import CHECKPOINTS_DIR, PathPolicy
from arctic_platform.server.store import MetadataStore

log = logging.getLogger(__name__)


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (links not followed; 0 if it is gone). The
    tenant's other saves may remove folders and files meanwhile (a replaced version, a staging
    folder, retention, a TTL): what is gone is not counted, and never fails the walk."""
    total = 0
    for parent, _, names in os.walk(folder):  # os.walk skips folders it cannot list
        for name in names:
            with contextlib.suppress(OSError):
                status = os.lstat(os.path.join(parent, name))
                if stat.S_ISREG(status.st_mode):
                    total += status.st_size
    return total


class CheckpointCatalogue:
    """Checkpoint records by job: record, list, look up, list files, delete, resolve a job's
    source checkpoint; at start, adopt legacy folders and recover interrupted saves."""

    def __init__(
        self, store: MetadataStore, paths: PathPolicy, jobs: JobRegistry, data_dir: Path
    ) -> None:
        self.store = store
        self.paths = paths
        self.jobs = jobs
        self.data_dir = data_dir
        self._expiring = threading.Lock()  # an expiry's delete, a save's publish (see publish)

    def record(
        self,
        sub: SubJob,
        saved: dict,
        checkpoint_type: str,
        avg_loss: float | None = None,
        *,
        expires_at: float | None = None,
    ) -> dict:
        """Catalogue what ``sub``'s engine just saved (``saved``: its id, path and step),
        replacing a record of the same id; ``expires_at``: when it is deleted (None: never)."""
        return self.adopt(
            sub.job_id,
            sub.sub_job_id,
            saved,
            checkpoint_type,
            avg_loss,
            created_at=time.time(),
            expires_at=expires_at,
        )

    def adopt(
        self,
        job_id: str,
        sub_job_id: str,
        saved: dict,
        checkpoint_type: str,
        avg_loss: float | None = None,
        *,
        created_at: float,
        expires_at: float | None = None,
    ) -> dict:
        """Catalogue a checkpoint saved at ``created_at`` by sub-job ``sub_job_id`` of
        ``job_id`` (:meth:`record`'s row; a folder an earlier server saved is adopted with its
        own time)."""
        record = {
            "job_id": job_id,
            "checkpoint_id": saved["checkpoint_id"],
            "sub_job_id": sub_job_id,
            "path": saved["path"],
            "global_steps": saved["global_step"],
            "avg_loss": avg_loss,
            "checkpoint_type": checkpoint_type,
            "created_at": created_at,
            "expires_at": expires_at,
            "nbytes": folder_bytes(Path(saved["path"])),
        }
        self.store.put_checkpoint(record)
        return record

    def publish(
        self,
        staging: Path,
        final: Path,
        sub: SubJob,
        saved: dict,
        checkpoint_type: str,
        *,
        expires_at: float | None = None,
    ) -> dict:
        """Publish a staged checkpoint folder as ``final`` and record it (``saved``: its id and
        step) in one step against the TTL expiry, which deletes a record and then its folder in
        one step too: so the expiry of an earlier version never removes a folder a save has just
        published under the same name."""
        with self._expiring:
            publish_folder(staging, final)
            return self.record(
                sub, {**saved, "path": str(final)}, checkpoint_type, expires_at=expires_at
            )

    def check_room(self, sub: SubJob) -> None:
        """Refuse a save by ``sub`` (409 ``limit_exceeded``, before anything is written) when what
        its owner's saves keep on disk and this one would pass the tenant quota's
        ``max_checkpoint_bytes_per_tenant``. What they keep is the owner's tenant folder, measured
        whole (a save replacing a record of the same id leaves its earlier folder there), and
        the catalogued checkpoints outside it (under ``--allow-write-path``; one whose record a
        save of the same id replaced is no longer counted); this save is estimated as the size
        of its job's largest checkpoint (a merged-weights export after adapter saves can be
        larger)."""
        quota = self.jobs.quota
        if quota.max_checkpoint_bytes_per_tenant is None:
            return
        owner = self.jobs.get(sub.job_id, None, check_owner=False).owner
        root = self.paths.tenant_root(owner).resolve()
        held, estimate, outside = folder_bytes(root), 0, set()
        for job in self.jobs.all():
            if job.owner != owner:
                continue
            for record in self._live(job.job_id):
                nbytes = record["nbytes"]
                if nbytes is None:  # catalogued before sizes were: measured now
                    nbytes = folder_bytes(Path(record["path"]))
                if job.job_id == sub.job_id:
                    estimate = max(estimate, nbytes)
                folder = Path(record["path"]).resolve()
                if not folder.is_relative_to(root) and folder not in outside:
                    outside.add(folder)
                    held += nbytes
        quota.check_checkpoints(held=held, estimate=estimate)

    def records(self, job_id: str, *, owner: str | None) -> list[dict]:
        """Records of ``owner``'s job ``job_id`` whose folders exist, oldest first (expired
        ones are deleted first)."""
        self.jobs.get(job_id, owner)
        return self._live(job_id)

    def _live(self, job_id: str) -> list[dict]:
        now, live = time.time(), []
        for record in self.store.checkpoints(job_id):
            if record["expires_at"] is not None and record["expires_at"] <= now:
                self._expire(job_id, record)
            elif Path(record["path"]).exists():
                live.append(record)
        return live

    def _expire(self, job_id: str, record: dict) -> None:
        """Delete an expired checkpoint: only the caller whose delete took this version's row
        removes its folder (not a second reader of the same row, nor after a save replaced it),
        and not while a save publishes (:meth:`publish`)."""
        with self._expiring:
            version = record["created_at"]
            if self.store.delete_checkpoint(job_id, record["checkpoint_id"], created_at=version):
                remove_published(Path(record["path"]))
                log.info("deleted %s: its TTL ran out", record["path"])

    def summaries(self, job_id: str, *, owner: str | None) -> list[dict]:
        """The job's checkpoints whose folders exist, without their paths."""
        return [
            {k: c[k] for k in ("checkpoint_id", "global_steps", "avg_loss", "checkpoint_type")}
            | {"created_at": c["created_at"]}
            for c in self.records(job_id, owner=owner)
        ]

    def get(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> dict:
        """The record of ``checkpoint_id`` in ``owner``'s job ``job_id`` (NotFound unless its
        folder exists)."""
        for record in self.records(job_id, owner=owner):
            if record["checkpoint_id"] == checkpoint_id:
                return record
        raise NotFound(
            f"checkpoint {checkpoint_id!r} not found in job {job_id}", field="checkpoint_id"
        )

    def set_expiry(
        self, job_id: str, checkpoint_id: str, expires_at: float | None, *, owner: str | None
    ) -> None:
        """Delete the checkpoint at ``expires_at`` (None: keep it)."""
        record = self.get(job_id, checkpoint_id, owner=owner)
        self.store.put_checkpoint(record | {"expires_at": expires_at})

    def files(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> list[dict]:
        """Files of a checkpoint: ``filename`` (relative), absolute ``path``, ``size_bytes``."""
        root = self._root(job_id, checkpoint_id, owner=owner)
        found = []
        for p in self.paths.within(root, sorted(root.rglob("*"))):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile: not listed
                if p.is_file():
                    found.append(
                        {
                            "filename": str(p.relative_to(root)),
                            "path": str(p),
                            "size_bytes": p.stat().st_size,
                        }
                    )
        return found

    def file(self, job_id: str, checkpoint_id: str, filename: str, *, owner: str | None) -> Path:
        """One file of a checkpoint by its relative name (what :meth:`files` lists), found
        without listing the others; a 404 for a name it does not list (gone, a link out)."""
        root = self._root(job_id, checkpoint_id, owner=owner)
        candidate = root / filename
        if candidate.is_file() and self.paths.within(root, [candidate]):
            return candidate
        raise NotFound(f"file {filename!r} not found in checkpoint {checkpoint_id}")

    def _root(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> Path:
        root = Path(self.get(job_id, checkpoint_id, owner=owner)["path"])
        job_owner = self.jobs.get(job_id, None, check_owner=False).owner
        self.paths.readable(job_owner, str(root), field="checkpoint")
        return root

    def delete(self, job_id: str, checkpoint_id: str, *, owner: str | None) -> None:
        """Unlist the checkpoint, then remove its folder (renamed out of sight first, so a crash
        part-way leaves nothing half-deleted under its name)."""
        record = self.get(job_id, checkpoint_id, owner=owner)
        path = self.paths.writable(owner, record["path"], field="checkpoint")
        self.store.delete_checkpoint(job_id, checkpoint_id)
        remove_published(path)

    def source(self, spec: SubJobConfig, owner: str | None, *, field: str) -> dict:
        """The record of the checkpoint a sub-job starts from (its ``source_checkpoint_info``),
        among ``owner``'s jobs: a 400 if it names several, a 404 if none that loads."""
        info = spec.source_checkpoint_info
        assert info is not None
        candidates = [
            j.job_id
            for j in self.jobs.all()
            if j.owner == owner and (info.source_job_id in (None, j.job_id))
        ]
        found = [
            c
            for job_id in candidates
            for c in self._live(job_id)
            if c["checkpoint_id"] == info.checkpoint_id
        ]
        where = f"{field}.source_checkpoint_info"
        named = f"checkpoint {info.checkpoint_id!r} in " + (
            f"job {info.source_job_id}" if info.source_job_id else "your jobs"
        )
        if len(found) > 1:
            raise BadRequest(f"{where}: {named} is ambiguous; set source_job_id", field=where)
        if found:
            self.paths.readable(owner, found[0]["path"], field=where)
        if not found or not is_loadable(found[0]["path"]):
            raise NotFound(f"{where}: {named} is not found", field=where)
        return found[0]

    def adopt_legacy(self) -> None:
        """Move checkpoints of the layout before tenant folders (``<data-dir>/checkpoints/<sub-job
        folder>``) into their job owner's space, where that owner (and only they) can load and
        export them. A folder whose job this server does not know stays where it is, served to
        no one, and the log names it for the operator."""
        legacy = self.data_dir.resolve() / CHECKPOINTS_DIR
        if not legacy.is_dir() or legacy.is_symlink():
            return
        for folder in sorted(legacy.iterdir()):
            job = self.jobs.find(folder.name.split("-", 1)[0])
            target = None if job is None else self.paths.checkpoint_root(job.owner) / folder.name
            if job is None or folder.is_symlink() or not folder.is_dir() or target.exists():
                log.warning(
                    "%s: checkpoints of the layout before tenant folders whose owner is not "
                    "known; not served to any tenant (move it into %s/<tenant>/%s/ to give it "
                    "to one)",
                    folder,
                    self.paths.root,
                    CHECKPOINTS_DIR,
                )
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            folder.rename(target)
            for record in self.store.checkpoints(job.job_id):
                old = Path(record["path"]).resolve()
                if old.is_relative_to(folder):
                    self.store.put_checkpoint(
                        record
                        | {"job_id": job.job_id, "path": str(target / old.relative_to(folder))}
                    )
            log.info("moved %s into its owner's space: %s", folder, target)

    def recover_folders(self) -> None:
        """Undo what saves killed with an earlier server process left (otherwise only undone by
        a later save into the same folder): a checkpoint being replaced is back under its name,
        half-written ones are gone (``engine/checkpoint_staging.py``)."""
        folders = set(self.paths.root.glob(f"*/{CHECKPOINTS_DIR}/*"))
        for job in self.jobs.all():
            folders.update(Path(c["path"]).parent for c in self.store.checkpoints(job.job_id))
        self.recover(folders)

    def recover(self, folders: Iterable[Path]) -> None:
        """Undo killed saves' leftovers in ``folders`` (the Tinker API adds its run folders)."""
        for path in recover(folders):
            log.info("recovered %s, left by a save that did not finish", path)
