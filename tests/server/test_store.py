"""The metadata store opens the SQLite file of an earlier version: a table made before a column
was added gains it, and the rows it held read the new column as unset."""

from __future__ import annotations

import sqlite3

from arctic_platform.server.store import MetadataStore

# The checkpoints table as the versions before checkpoint expiry made it.
BEFORE_EXPIRY = """
CREATE TABLE checkpoints (
    job_id TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,
    sub_job_id TEXT NOT NULL,
    path TEXT NOT NULL,
    global_steps INTEGER NOT NULL,
    avg_loss REAL,
    checkpoint_type TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (job_id, checkpoint_id)
);
INSERT INTO checkpoints
    VALUES ('j1', 'checkpoint-3', 'j1:training:0', '/x', 3, 0.5, 'resumable', 1.0);
"""


def test_a_store_of_an_earlier_version_gains_the_expiry_and_size_columns(tmp_path):
    file = tmp_path / "metadata.sqlite3"
    with sqlite3.connect(file) as db:
        db.executescript(BEFORE_EXPIRY)
    store = MetadataStore(file)
    (old,) = store.checkpoints("j1")
    assert old["checkpoint_id"] == "checkpoint-3" and old["global_steps"] == 3
    assert old["expires_at"] is None and old["nbytes"] is None
    store.put_checkpoint(old | {"checkpoint_id": "checkpoint-4", "expires_at": 99.0, "nbytes": 7})
    store.close()

    reopened = MetadataStore(file)  # a second open adds nothing twice
    rows = reopened.checkpoints("j1")
    assert [(c["expires_at"], c["nbytes"]) for c in rows] == [(None, None), (99.0, 7)]
    reopened.close()


def test_a_delete_of_one_version_leaves_the_version_that_replaced_it(tmp_path):
    """The TTL expiry deletes the version it read: a save that replaced it since keeps its row,
    and a second delete of the same version takes nothing (so it removes no folder)."""
    store = MetadataStore(tmp_path / "metadata.sqlite3")
    old = {"job_id": "j1", "checkpoint_id": "weights-a", "sub_job_id": "j1:training:0"}
    old |= {"path": "/x", "global_steps": 1, "checkpoint_type": "resumable", "created_at": 1.0}
    store.put_checkpoint(old | {"expires_at": 2.0})
    store.put_checkpoint(old | {"created_at": 5.0})  # a save replaced it
    assert not store.delete_checkpoint("j1", "weights-a", created_at=1.0)
    assert [c["created_at"] for c in store.checkpoints("j1")] == [5.0]
    assert store.delete_checkpoint("j1", "weights-a", created_at=5.0)
    assert not store.delete_checkpoint("j1", "weights-a", created_at=5.0)
    assert store.checkpoints("j1") == []
    store.close()
