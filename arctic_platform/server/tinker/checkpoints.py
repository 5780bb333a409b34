"""``tinker://`` paths onto the Service's one checkpoint catalogue.

``tinker://<model_id>/weights/<name>`` is a training state (LoRA weights + AdamW state, written by
``save_state``), ``tinker://<model_id>/sampler_weights/<name>`` merged weights a sampler loads
(``save_weights_for_sampler``, exported in HF format) and ``.../external_weights/<name>`` merged
HF weights for download (``save_weights_external``). Each is a record of the run's job in
:class:`~arctic_platform.server.checkpoint_catalogue.CheckpointCatalogue` (id ``<kind>-<name>``,
its TTL the record's expiry), so the on-prem and Cortex checkpoint routes list, download and
delete them too; the run itself (its job, base model and LoRA rank) is a row of the metadata
store, so checkpoints, their listing and ``create_training_client_from_state`` survive a server
restart. The folders live in the owner's tenant space
(``<data_dir>/tenants/<owner>/tinker/runs/<model_id>/<kind>/<name>/``), so the Service's path
policy lets that owner's samplers load them.

Saves and overwrites go through :mod:`arctic_platform.engine.checkpoint_staging`: a checkpoint is
written beside its name and swapped in by rename, so a server killed at any moment leaves each
name holding a complete version (the old one until the new one is in place), and the catalogue
undoes a killed save's leftovers at start. A checkpoint is listed only when it loads; one that is
missing or incomplete is a 404. Servers before the catalogue kept a ``run.json`` and an
``expiry.json`` per run: :meth:`TinkerCheckpoints.adopt_legacy` moves those into it at start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from arctic_platform.contract.job_ids import sub_job_id
from arctic_platform.engine import checkpoint_layout as layout
from arctic_platform.engine import checkpoint_staging as staging
from arctic_platform.engine.errors import CheckpointNotFound
from arctic_platform.server import paths
from arctic_platform.server.checkpoint_catalogue import CheckpointCatalogue
from arctic_platform.server.errors import BadRequest, Conflict, NotFound
from arctic_platform.server.job_registry import SubJob
from arctic_platform.server.store import MetadataStore

log = logging.getLogger(__name__)

SCHEME = "tinker://"
# The folder of each tenant's space that holds its Tinker runs and checkpoints.
TINKER_DIR = "tinker"
# The SDK's documented TTL range: one hour to ten years.
TTL_RANGE_S = (3600, 10 * 365 * 24 * 3600)
KIND_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
# Each kind's type in the catalogue, in the on-prem save's terms (``SaveBody.checkpoint_type``): a
# training state resumes a run; the other two are merged weights.
CATALOGUE_TYPES = {
    "weights": "resumable",
    "sampler_weights": "weights-only",
    "external_weights": "weights-only",
}


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, value: str, *, field: str = "path") -> TinkerPath:
        parts = value[len(SCHEME) :].split("/") if value.startswith(SCHEME) else []
        if len(parts) != 3 or parts[1] not in KIND_TYPES or not all(parts):
            kinds = "|".join(KIND_TYPES)
            raise BadRequest(
                f"{field}: {value!r} is not a tinker path (tinker://<model_id>/<{kinds}>/<name>)",
                field=field,
            )
        return cls(parts[0], parts[1], check_name(parts[2], field=field))

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """Its id in the catalogue (no ``/``: the on-prem and Cortex routes take it as one
        path segment)."""
        return f"{self.kind}-{self.name}"


def check_name(name: str | None, *, field: str = "path") -> str:
    """``name`` if it can name a checkpoint folder (the server's one rule, ``paths.check_name``,
    with room left for its staging names); else a 400 naming ``field``."""
    return paths.check_name(
        name, field=field, max_bytes=paths.NAME_MAX_BYTES - staging.NAME_OVERHEAD
    )


def check_ttl(ttl_seconds: int | None) -> None:
    if ttl_seconds is not None and not TTL_RANGE_S[0] <= ttl_seconds <= TTL_RANGE_S[1]:
        raise BadRequest(
            f"ttl_seconds: must be between {TTL_RANGE_S[0]} and {TTL_RANGE_S[1]} or null",
            field="ttl_seconds",
        )


class TinkerCheckpoints:
    """Tinker's runs and named checkpoints, kept by the metadata store and the Service's
    checkpoint catalogue (see module doc)."""

    def __init__(
        self,
        catalogue: CheckpointCatalogue,
        store: MetadataStore,
        policy: paths.PathPolicy,
    ) -> None:
        self._catalogue = catalogue
        self._store = store
        # The tenants' spaces, where the runs live; folders are resolved where they are written
        # or read (links followed): a run folder the tenant linked out of its space (a shared
        # filesystem) is refused, not followed.
        self._policy = policy

    def _run_dir(self, owner: str | None, model_id: str) -> Path:
        return self._policy.tenant_root(owner) / TINKER_DIR / "runs" / model_id.replace(":", "_")

    def record_run(
        self, model_id: str, *, owner: str | None, job_id: str, base_model: str, rank: int
    ) -> None:
        record = {
            "model_id": model_id,
            "owner": owner,
            "job_id": job_id,
            "base_model": base_model,
            "lora_rank": rank,
            "created_at": time.time(),
        }
        self._store.put_tinker_run(record)

    def run_record(self, model_id: str, owner: str | None) -> dict:
        """The run's record; 404 if unknown or another owner's."""
        record = self._store.tinker_run(model_id)
        if record is None or record["owner"] != owner:
            raise NotFound(f"training run {model_id!r} not found")
        return record

    def runs(self, owner: str | None) -> list[dict]:
        return self._store.tinker_runs(owner)

    def _job_id(self, model_id: str, owner: str | None) -> str:
        """The id of the run's job, whose checkpoints the run's are (404 as for the run)."""
        return self.run_record(model_id, owner)["job_id"]

    def save(
        self,
        path: TinkerPath,
        owner: str | None,
        sub: SubJob,
        write: Callable[[Path], dict],
        *,
        overwrite: bool,
        ttl_seconds: int | None,
    ) -> None:
        """Write ``path``'s new version with ``write(folder)`` (the engine's save, returning
        its ``global_step``), publish it under its name (replacing an existing version only
        then; without ``overwrite`` a 409) and catalogue it as ``sub``'s."""
        check_ttl(ttl_seconds)
        directory = self._run_dir(owner, path.model_id) / path.kind / path.name
        self._policy.writable(owner, str(directory), field="path")
        if not overwrite and (self._find(path, owner) is not None or directory.exists()):
            raise Conflict(f"checkpoint {path} already exists; pass overwrite=True")
        self._catalogue.check_room(sub)
        step: list[int] = []  # the engine's step, once written

        def publish(folder: Path, final: Path) -> None:
            saved = {"checkpoint_id": path.checkpoint_id, "global_step": step[0]}
            kind = CATALOGUE_TYPES[path.kind]
            self._catalogue.publish(
                folder, final, sub, saved, kind, expires_at=_expiry(ttl_seconds)
            )

        with staging.staged(directory, publisher=publish) as folder:
            step.append(write(folder)["global_step"])

    def set_ttl(self, path: TinkerPath, owner: str | None, ttl_seconds: int | None) -> None:
        """Expire ``path`` ``ttl_seconds`` from now (None: never)."""
        check_ttl(ttl_seconds)
        self.resolve(path, owner)
        job_id = self._job_id(path.model_id, owner)
        self._catalogue.set_expiry(job_id, path.checkpoint_id, _expiry(ttl_seconds), owner=owner)

    def _find(self, path: TinkerPath, owner: str | None) -> dict | None:
        """The catalogue's record of ``path`` (None if absent or expired)."""
        job_id = self._job_id(path.model_id, owner)
        with contextlib.suppress(NotFound):
            return self._catalogue.get(job_id, path.checkpoint_id, owner=owner)
        return None

    def resolve(self, path: TinkerPath, owner: str | None) -> Path:
        """The saved checkpoint folder of ``path`` (``.../checkpoint-<step>``); 404 if absent."""
        record = self._find(path, owner)
        with contextlib.suppress(CheckpointNotFound):
            if record is not None:
                folder = layout.resolve_checkpoint(record["path"], None)
                return self._policy.readable(owner, str(folder), field="path")
        raise NotFound(f"checkpoint {path} not found")

    def sampler_model_dir(self, path: TinkerPath, owner: str | None) -> Path:
        """The HF folder a sampler loads for a ``sampler_weights`` path."""
        if path.kind != "sampler_weights":
            raise BadRequest(
                f"model_path: {path} is a training state; sample from a sampler_weights path "
                "(save_weights_for_sampler)",
                field="model_path",
            )
        hf = self.resolve(path, owner) / layout.HF_EXPORT_DIR
        if not (hf / "config.json").is_file():
            raise NotFound(f"checkpoint {path} has no exported weights")
        return hf

    def exported_files(self, path: TinkerPath, owner: str | None) -> dict[str, Path]:
        """The HF files of an ``external_weights`` checkpoint, by path relative to its root."""
        if path.kind != "external_weights":
            raise BadRequest(
                f"{path}: only external_weights checkpoints are downloadable", field="checkpoint"
            )
        root = self.resolve(path, owner) / layout.HF_EXPORT_DIR
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def list(self, model_id: str, owner: str | None) -> list[dict]:
        """``Checkpoint`` objects of a run, oldest first (none for a run whose job ended
        without one and was since dropped from its owner's history)."""
        job_id = self._job_id(model_id, owner)
        try:
            records = self._catalogue.records(job_id, owner=owner)
        except NotFound:
            return []
        found = []
        for record in records:
            path = _tinker_path(model_id, record)
            if path is None or not layout.is_loadable(record["path"]):
                continue  # an on-prem save of the run's job, or a checkpoint whose files are gone
            files = [p for p in Path(record["path"]).rglob("*") if p.is_file()]
            found.append(
                {
                    "checkpoint_id": f"{path.kind}/{path.name}",
                    "checkpoint_type": KIND_TYPES[path.kind],
                    "time": _iso(record["created_at"]),
                    "tinker_path": str(path),
                    "size_bytes": sum(p.stat().st_size for p in files),
                    "public": False,
                    "expires_at": None
                    if record["expires_at"] is None
                    else _iso(record["expires_at"]),
                }
            )
        return found

    def delete(self, path: TinkerPath, owner: str | None) -> None:
        self.resolve(path, owner)
        self._catalogue.delete(self._job_id(path.model_id, owner), path.checkpoint_id, owner=owner)

    def recover(self, roots: Iterable[Path]) -> None:
        """Undo what killed saves left under the Tinker folders ``roots`` (one per owner): in
        each run's kind folders, where a first save of a name has no record yet."""
        self._catalogue.recover(
            folder
            for root in roots
            for kind in KIND_TYPES
            for folder in root.glob(f"runs/*/{kind}")
        )

    def adopt_legacy(self, roots: Iterable[Path], job_of: Callable[[dict], str | None]) -> None:
        """Move the ``run.json`` / ``expiry.json`` records of servers before the catalogue (under
        the Tinker folders ``roots``) into the store and the catalogue. ``job_of(run)`` finds the
        run's job; a run whose job this server does not know stays unlisted, and the log names
        it for the operator."""
        for file in sorted(p for root in roots for p in root.glob("runs/*/run.json")):
            run = json.loads(file.read_text())
            job_id = job_of(run)
            if job_id is None:
                log.warning("%s: its job is not known here; its checkpoints are not served", file)
                continue
            expiry_file = file.with_name("expiry.json")
            expiry = json.loads(expiry_file.read_text()) if expiry_file.is_file() else {}
            self._store.put_tinker_run(run | {"job_id": job_id})
            for kind, checkpoint_type in CATALOGUE_TYPES.items():
                for folder in sorted((file.parent / kind).glob("*")):
                    if folder.name.startswith(".") or not layout.is_loadable(folder):
                        continue
                    path = TinkerPath(run["model_id"], kind, folder.name)
                    saved = {
                        "checkpoint_id": path.checkpoint_id,
                        "path": str(folder),
                        "global_step": _step(folder),
                    }
                    self._catalogue.adopt(
                        job_id,
                        sub_job_id(job_id, "training", 0),
                        saved,
                        checkpoint_type,
                        created_at=folder.stat().st_mtime,
                        expires_at=expiry.get(f"{kind}/{folder.name}"),
                    )
            expiry_file.unlink(missing_ok=True)
            file.unlink()
            log.info("catalogued the checkpoints of Tinker run %s", run["model_id"])


def _tinker_path(model_id: str, record: dict) -> TinkerPath | None:
    """The ``tinker://`` path of a catalogue record of ``model_id``'s job (None: not a Tinker
    save; no kind is a prefix of another)."""
    for kind in KIND_TYPES:
        if record["checkpoint_id"].startswith(prefix := f"{kind}-"):
            return TinkerPath(model_id, kind, record["checkpoint_id"][len(prefix) :])
    return None


def _step(folder: Path) -> int:
    """The step of the checkpoint a folder's ``latest`` names."""
    name = layout.resolve_checkpoint(folder, None).name
    return int(layout.CHECKPOINT_PATTERN.match(name).group(1))


def _expiry(ttl_seconds: int | None) -> float | None:
    return None if ttl_seconds is None else time.time() + ttl_seconds


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()
