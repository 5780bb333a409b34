"""TensorBoard: event files under ``<run_dir>/tensorboard`` through torch's ``SummaryWriter``.

The writer is opened with ``purge_step`` at the first step this process runs: TensorBoard's
readers then drop events the same directory holds at or past that step (an interrupted segment's
steps after its checkpoint, or an earlier run's when the directory is reused), so each step shows
once, with the values of the segment that carried on.
"""

from __future__ import annotations

import json
from typing import Any

from arctic_platform.recipes.trackers import RunInfo

LOG_DIR = "tensorboard"


class TensorBoardTracker:
    rewinds = True

    def __init__(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = info.run_dir / LOG_DIR
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=info.start_step)
        if info.start_step == 0:
            self._writer.add_text(
                "config", f"```json\n{json.dumps(info.config, indent=2)}\n```", global_step=0
            )

    def identity(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir)}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # visible to a running TensorBoard at once

    def close(self, *, failed: bool) -> None:
        self._writer.close()
