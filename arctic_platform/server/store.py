"""Job and checkpoint metadata that outlives the server process (SQLite in the data dir).

Engines live in memory and die with the process; what a user needs after a restart is the list of
jobs (with how they ended) and their checkpoints, so a new job can start from one; the Tinker
training runs (so their checkpoints load and list after it); and which Tinker session ids this
server issued, so a session lost in a restart is told it ended (410) rather than that it never
existed (404). SQLite is in the standard library, transactional and safe against a crash
mid-write.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    owner TEXT,
    status TEXT NOT NULL,
    reason TEXT,
    experiment_name TEXT,
    request TEXT NOT NULL,
    sub_jobs TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    sub_job_id TEXT NOT NULL,
    path TEXT NOT NULL,
    global_steps INTEGER NOT NULL,
    avg_loss REAL,
    checkpoint_type TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    nbytes INTEGER,
    PRIMARY KEY (job_id, checkpoint_id)
);
CREATE TABLE IF NOT EXISTS tinker_sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tinker_runs (
    model_id TEXT PRIMARY KEY,
    owner TEXT,
    job_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_rank INTEGER NOT NULL,
    created_at REAL NOT NULL
);
"""
# Columns added to a table after its first release: (table, column, declaration). A store made
# by an earlier version gains them at open; their rows read the column as NULL.
_ADDED_COLUMNS = (("checkpoints", "expires_at", "REAL"), ("checkpoints", "nbytes", "INTEGER"))
_CHECKPOINT_KEYS = (
    "job_id",
    "checkpoint_id",
    "sub_job_id",
    "path",
    "global_steps",
    "avg_loss",
    "checkpoint_type",
    "created_at",
    "expires_at",
    "nbytes",
)
_TINKER_RUN_KEYS = ("model_id", "owner", "job_id", "base_model", "lora_rank", "created_at")


class MetadataStore:
    """Thread-safe access to the jobs, checkpoints and Tinker tables."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        for table, column, declaration in _ADDED_COLUMNS:
            present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def put_job(self, record: dict[str, Any]) -> None:
        """Insert or replace one job row (``request`` and ``sub_jobs`` are stored as JSON)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record["job_id"],
                    record["owner"],
                    record["status"],
                    record["reason"],
                    record["experiment_name"],
                    json.dumps(record["request"]),
                    json.dumps(record["sub_jobs"]),
                    record["created_at"],
                    record["updated_at"],
                ),
            )

    def jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
        keys = ("job_id", "owner", "status", "reason", "experiment_name", "request", "sub_jobs")
        out = []
        for row in rows:
            record = dict(zip((*keys, "created_at", "updated_at"), row, strict=True))
            record["request"] = json.loads(record["request"])
            record["sub_jobs"] = json.loads(record["sub_jobs"])
            out.append(record)
        return out

    def jobs_with_checkpoints(self) -> set[str]:
        """The ids of the jobs that have a checkpoint row."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT job_id FROM checkpoints").fetchall()
        return {row[0] for row in rows}

    def delete_job(self, job_id: str) -> None:
        """Delete the job's row (one dropped from its owner's history)."""
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))

    def put_checkpoint(self, record: dict[str, Any]) -> None:
        """Insert or replace one checkpoint row (``expires_at`` may be absent: never;
        ``nbytes``, its folder's size, absent: not measured)."""
        row = tuple(record.get(key) for key in _CHECKPOINT_KEYS)
        marks = ", ".join("?" * len(_CHECKPOINT_KEYS))
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO checkpoints VALUES ({marks})", row)

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        """The job's checkpoint rows, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_CHECKPOINT_KEYS)} FROM checkpoints WHERE job_id = ?"
                " ORDER BY created_at",
                (job_id,),
            ).fetchall()
        return [dict(zip(_CHECKPOINT_KEYS, row, strict=True)) for row in rows]

    def delete_checkpoint(
        self, job_id: str, checkpoint_id: str, *, created_at: float | None = None
    ) -> bool:
        """Delete the row (only the version made at ``created_at``, when given: not one that
        replaced it since it was read); whether a row went."""
        query = "DELETE FROM checkpoints WHERE job_id = ? AND checkpoint_id = ?"
        values: tuple = (job_id, checkpoint_id)
        if created_at is not None:
            query, values = query + " AND created_at = ?", (*values, created_at)
        with self._lock:
            return self._db.execute(query, values).rowcount > 0

    def put_tinker_session(self, session_id: str, owner: str | None, created_at: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO tinker_sessions VALUES (?, ?, ?)",
                (session_id, owner, created_at),
            )

    def tinker_session(self, session_id: str) -> dict[str, Any] | None:
        """The record of a Tinker session this server issued (in any run), or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT owner, created_at FROM tinker_sessions WHERE session_id = ?",
                (session_id,),
            ).fetchone()
        return None if row is None else {"owner": row[0], "created_at": row[1]}

    def put_tinker_run(self, record: dict[str, Any]) -> None:
        """Insert or replace a Tinker training run's record (its job, base model, LoRA rank)."""
        row = tuple(record[key] for key in _TINKER_RUN_KEYS)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO tinker_runs VALUES (?, ?, ?, ?, ?, ?)", row)

    def tinker_run(self, model_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {', '.join(_TINKER_RUN_KEYS)} FROM tinker_runs WHERE model_id = ?",
                (model_id,),
            ).fetchone()
        return None if row is None else dict(zip(_TINKER_RUN_KEYS, row, strict=True))

    def tinker_runs(self, owner: str | None) -> list[dict[str, Any]]:
        """``owner``'s Tinker training runs, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_TINKER_RUN_KEYS)} FROM tinker_runs"
                " WHERE owner IS ? ORDER BY created_at",
                (owner,),
            ).fetchall()
        return [dict(zip(_TINKER_RUN_KEYS, row, strict=True)) for row in rows]
