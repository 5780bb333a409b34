"""Where checkpoints live on disk and how a folder is found: names and lookups, no tensors.

``<job_dir>/checkpoint-<step>/`` folders (what :mod:`arctic_platform.engine.checkpoint` writes),
the ``latest`` pointer, the file names inside. Kept apart from the reading and writing of
tensors so that the server's edges (the Tinker checkpoint catalogue, the Service's listing) can
find and check checkpoints without importing torch.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from arctic_platform.engine.errors import CheckpointNotFound

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
LATEST_FILE = "latest"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pt"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HF_EXPORT_DIR = "hf"


def checkpoint_id(step: int) -> str:
    return f"checkpoint-{step}"


def resolve_checkpoint(path: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint folder meant by ``path``: itself, ``checkpoint-<step>``, or ``latest``.

    ``path`` is a checkpoint folder or a job folder. In a job folder without ``step``, ``latest``
    decides; if it is missing or names a folder that is gone, the newest complete checkpoint does.
    """
    base = Path(path)
    if step is None and (base / TRAINER_STATE).is_file():
        return base
    if step is not None:
        candidate = base / checkpoint_id(step)
        if not (candidate / TRAINER_STATE).is_file():
            raise CheckpointNotFound("step", f"no checkpoint for step {step} in {base}")
        return candidate
    latest = base / LATEST_FILE
    if latest.is_file():
        text = latest.read_text().strip()
        name = checkpoint_id(int(text)) if text.isdigit() else text
        if (base / name / TRAINER_STATE).is_file():
            return base / name
    complete = [p for _, p in list_checkpoints(base) if (p / TRAINER_STATE).is_file()]
    if not complete:
        raise CheckpointNotFound("path", f"no checkpoint found in {base}")
    return complete[-1]


def is_loadable(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint :func:`resolve_checkpoint` finds."""
    try:
        resolve_checkpoint(path)
    except CheckpointNotFound:
        return False
    return True


def list_checkpoints(job_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the job's ``checkpoint-<step>`` folders, oldest first."""
    if not job_dir.is_dir():
        return []
    found = []
    for entry in job_dir.iterdir():
        match = CHECKPOINT_PATTERN.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def prune_checkpoints(job_dir: Path, keep: int, *, keep_name: str | None = None) -> list[str]:
    """Delete all but the newest ``keep`` checkpoint folders (never ``keep_name``).

    Returns the names of the deleted folders. A link among them is removed itself, never what
    it points at (a folder outside the job's, perhaps another tenant's).
    """
    checkpoints = list_checkpoints(job_dir)
    doomed = [p for _, p in checkpoints[: max(0, len(checkpoints) - keep)] if p.name != keep_name]
    for path in doomed:
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path)
    return [p.name for p in doomed]
