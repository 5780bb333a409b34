"""Weights & Biases through ``wandb.init``/``run.log``, honouring wandb's own environment.

``WANDB_MODE`` (``offline`` writes ``wandb/offline-run-*`` for a later ``wandb sync``),
``WANDB_API_KEY``, ``WANDB_ENTITY`` and the rest are read by wandb itself. Files go under
``WANDB_DIR`` when set, else the run directory. The run id is kept in ``tracking.json`` and a
resumed run reopens it (``resume="allow"``), logging on the same ``step`` axis.
"""

from __future__ import annotations

import os
from typing import Any

from arctic_platform.recipes.trackers import RunInfo


class WandbTracker:
    rewinds = False

    def __init__(self, info: RunInfo) -> None:
        import wandb

        self._run = wandb.init(
            project=info.project,
            name=info.run_name,
            id=info.previous["run_id"] if info.previous else None,
            resume="allow",
            dir=os.environ.get("WANDB_DIR") or str(info.run_dir),
            config=info.config,
            reinit="create_new",
        )
        self.run_id = self._run.id

    def identity(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
