"""``tinker://`` paths and where their checkpoints live on disk.

``tinker://<model_id>/weights/<name>`` is a training state (LoRA weights + AdamW state, written by
``save_state``), ``tinker://<model_id>/sampler_weights/<name>`` merged weights a sampler loads
(``save_weights_for_sampler``, exported in HF format) and ``.../external_weights/<name>`` merged
HF weights for download (``save_weights_external``). All live in the owner's tenant folder
(``<data_dir>/tenants/<owner>/tinker/runs/<model_id>/<kind>/<name>/``, so the Service's path
policy lets that owner's samplers load them) with a ``run.json`` per run (its base model, LoRA
rank and owner), so checkpoints, their listing and ``create_training_client_from_state`` survive
a server restart.

Saves, overwrites and deletes go through :mod:`arctic_platform.engine.checkpoint_staging`: a
checkpoint is written beside its name and swapped in by rename, so a server killed at any moment
leaves each name holding a complete version (the old one until the new one is in place), and
:meth:`CheckpointStore.recover` undoes a killed save's leftovers at start. A checkpoint is listed
only when it loads; one that is missing or incomplete is a 404.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from arctic_platform.engine import checkpoint_layout as layout
from arctic_platform.engine import checkpoint_staging as staging
from arctic_platform.engine.errors import CheckpointNotFound
from arctic_platform.server import paths
from arctic_platform.server.errors import BadRequest, Conflict, NotFound

SCHEME = "tinker://"
# The SDK's documented TTL range: one hour to ten years.
TTL_RANGE_S = (3600, 10 * 365 * 24 * 3600)
KIND_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


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


class CheckpointStore:
    """Run records and checkpoint folders, under each owner's root (see module doc)."""

    def __init__(self, root_of: Callable[[str | None], Path]) -> None:
        self._root_of = root_of

    def _run_dir(self, owner: str | None, model_id: str) -> Path:
        return self._root_of(owner) / "runs" / model_id.replace(":", "_")

    def record_run(self, model_id: str, *, owner: str | None, base_model: str, rank: int) -> None:
        directory = self._run_dir(owner, model_id)
        directory.mkdir(parents=True, exist_ok=True)
        record = {
            "model_id": model_id,
            "owner": owner,
            "base_model": base_model,
            "lora_rank": rank,
            "created_at": time.time(),
        }
        staging.write_text_atomic(directory / "run.json", json.dumps(record))

    def run_record(self, model_id: str, owner: str | None) -> dict:
        """The run's record; 404 if unknown or another owner's."""
        path = self._run_dir(owner, model_id) / "run.json"
        record = json.loads(path.read_text()) if path.is_file() else None
        if record is None or record["owner"] != owner:
            raise NotFound(f"training run {model_id!r} not found")
        return record

    def runs(self, owner: str | None) -> list[dict]:
        records = [json.loads(p.read_text()) for p in self._root_of(owner).glob("runs/*/run.json")]
        return sorted((r for r in records if r["owner"] == owner), key=lambda r: r["created_at"])

    @contextlib.contextmanager
    def saving(self, path: TinkerPath, owner: str | None, *, overwrite: bool) -> Iterator[Path]:
        """The folder to write ``path``'s new version into; published under ``path`` when the
        body ends, replacing an existing version only then (``overwrite``: else a 409)."""
        directory = self._run_dir(owner, path.model_id) / path.kind / path.name
        if directory.exists() and not overwrite:
            raise Conflict(f"checkpoint {path} already exists; pass overwrite=True")
        with staging.staged(directory) as folder:
            yield folder

    def recover(self, roots: Iterable[Path]) -> list[Path]:
        """Undo what killed saves left under the Tinker folders ``roots`` (one per owner): in
        each run's kind folders and in each checkpoint's own folder."""
        folders = []
        for root in roots:
            for kind in KIND_TYPES:
                folders += root.glob(f"runs/*/{kind}")
                folders += root.glob(f"runs/*/{kind}/*")
        return staging.recover(folders)

    def set_ttl(self, path: TinkerPath, owner: str | None, ttl_seconds: int | None) -> None:
        """Expire ``path`` ``ttl_seconds`` from now (None: never). An expired checkpoint is
        deleted the next time its run's checkpoints are looked at."""
        check_ttl(ttl_seconds)
        self.resolve(path, owner)
        expiry = self._expiry(owner, path.model_id)
        key = f"{path.kind}/{path.name}"
        if ttl_seconds is None:
            expiry.pop(key, None)
        else:
            expiry[key] = time.time() + ttl_seconds
        self._write_expiry(owner, path.model_id, expiry)

    def _write_expiry(self, owner: str | None, model_id: str, expiry: dict[str, float]) -> None:
        file = self._run_dir(owner, model_id) / "expiry.json"
        staging.write_text_atomic(file, json.dumps(expiry))

    def _expiry(self, owner: str | None, model_id: str) -> dict[str, float]:
        file = self._run_dir(owner, model_id) / "expiry.json"
        return json.loads(file.read_text()) if file.is_file() else {}

    def _sweep(self, owner: str | None, model_id: str) -> None:
        expiry = self._expiry(owner, model_id)
        expired = [key for key, at in expiry.items() if at <= time.time()]
        for key in expired:
            staging.remove_published(self._run_dir(owner, model_id) / key)
            del expiry[key]
        if expired:
            self._write_expiry(owner, model_id, expiry)

    def resolve(self, path: TinkerPath, owner: str | None) -> Path:
        """The saved checkpoint folder of ``path`` (``.../checkpoint-<step>``); 404 if absent."""
        self.run_record(path.model_id, owner)
        self._sweep(owner, path.model_id)
        directory = self._run_dir(owner, path.model_id) / path.kind / path.name
        try:
            return layout.resolve_checkpoint(directory, None)
        except CheckpointNotFound:
            raise NotFound(f"checkpoint {path} not found") from None

    def sampler_model_dir(self, path: TinkerPath, owner: str | None) -> Path:
        """The HF folder a sampler loads for a ``sampler_weights`` path."""
        if path.kind != "sampler_weights":
            raise BadRequest(
                f"model_path: {path} is a training state; sample from a sampler_weights path "
                "(save_weights_for_sampler)",
                field="model_path",
            )
        hf = self.resolve(path, owner) / "hf"
        if not (hf / "config.json").is_file():
            raise NotFound(f"checkpoint {path} has no exported weights")
        return hf

    def exported_files(self, path: TinkerPath, owner: str | None) -> dict[str, Path]:
        """The HF files of an ``external_weights`` checkpoint, by path relative to its root."""
        if path.kind != "external_weights":
            raise BadRequest(f"{path}: only external_weights checkpoints are downloadable")
        root = self.resolve(path, owner) / "hf"
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def list(self, model_id: str, owner: str | None) -> list[dict]:
        """``Checkpoint`` objects of a run, oldest first."""
        self.run_record(model_id, owner)
        self._sweep(owner, model_id)
        expiry = self._expiry(owner, model_id)
        found = []
        for kind, ctype in KIND_TYPES.items():
            for directory in (self._run_dir(owner, model_id) / kind).glob("*"):
                if directory.name.startswith(".") or not layout.is_loadable(directory):
                    continue  # a save under way, or a checkpoint whose files are gone
                files = [p for p in directory.rglob("*") if p.is_file()]
                found.append(
                    {
                        "checkpoint_id": f"{kind}/{directory.name}",
                        "checkpoint_type": ctype,
                        "time": _iso(directory.stat().st_mtime),
                        "tinker_path": str(TinkerPath(model_id, kind, directory.name)),
                        "size_bytes": sum(p.stat().st_size for p in files),
                        "public": False,
                        "expires_at": _iso(expiry[f"{kind}/{directory.name}"])
                        if f"{kind}/{directory.name}" in expiry
                        else None,
                    }
                )
        return sorted(found, key=lambda c: c["time"])

    def delete(self, path: TinkerPath, owner: str | None) -> None:
        self.resolve(path, owner)
        staging.remove_published(self._run_dir(owner, path.model_id) / path.kind / path.name)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()
