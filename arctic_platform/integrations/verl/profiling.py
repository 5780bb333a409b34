"""Profiling windows of the arctic forwarder (verl's ``start_profile`` / ``stop_profile``).

When ``global_profiler.steps`` is set, verl's trainer brackets each profiled step with
``start_profile(role=..., profile_step=N)`` and ``stop_profile(run_command=...)`` on its worker
groups. The forwarder has no GPU kernels of its own, so it records what does run in its process
with ``torch.profiler`` (CPU activities: batch conversion, client calls, and the engines
themselves under the ``inprocess`` backend) and writes a Chrome trace per window to
``global_profiler.save_path``. Servers behind other backends are profiled on their own side.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class ForwarderProfiler:
    """One ``torch.profiler`` window at a time; :meth:`stop` writes its trace."""

    def __init__(self, save_path: str | Path, rank: int) -> None:
        self.save_path = Path(save_path)
        self.rank = rank
        self._profiler: torch.profiler.profile | None = None
        self._step: int | None = None
        self._role: str | None = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self, *, role: str | None = None, step: int | None = None) -> None:
        """Open a window (a second start while one is open keeps the first)."""
        if self._profiler is not None:
            return
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.start()
        self._profiler, self._role, self._step = profiler, role, step

    def stop(self, *, run_command: bool = False) -> Path | None:
        """Close the window and write ``arctic_forwarder_step{N}_{role}_rank{R}.json``."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return None
        profiler.stop()
        self.save_path.mkdir(parents=True, exist_ok=True)
        name = f"arctic_forwarder_step{self._step}_{self._role or 'all'}_rank{self.rank}.json"
        path = self.save_path / name
        profiler.export_chrome_trace(str(path))
        if run_command:
            log.info("profile trace %s written; the arctic forwarder runs no finish command", path)
        return path
