"""Experiment trackers for recipe runs: the same per-step metrics and config to each.

``metrics.jsonl`` (:class:`~arctic_platform.recipes.run_log.MetricsLog`) is the run's own record;
the trackers named in ``logging.backends`` (TensorBoard, Weights & Biases, MLflow) receive each
step's numeric metrics as ``<phase>/<name>`` scalars (:func:`tracked_scalars`) on the run's step
axis, and the recipe config once. Each writes through its own library, installed with the
``tracking`` extra.

Resume continues the same tracker run. ``tracking.json`` in the run directory keeps each tracker's
run identity and the last step it received. On resume:

* TensorBoard is reopened with ``purge_step`` at the resumed step, so its readers drop the events
  the interrupted segment wrote past the checkpoint, and the steps are written again;
* wandb and MLflow only append, so the steps they already hold are not sent again (a recipe's
  metrics are a function of the step, so they are the same numbers);
* a tracker that the run did not use before is first sent the earlier steps from
  ``metrics.jsonl``.

Either way every tracker ends with each step exactly once.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from arctic_platform._extras import require

TRACKING_FILE = "tracking.json"
EXTRA = "tracking"
# The record keys that place a step rather than measure it.
_AXIS_KEYS = ("step", "phase")


def tracked_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record as tracker scalars: ``{"<phase>/<key>": value}`` for its numbers.

    The phase prefix keeps SFT and GRPO losses (different scales) on separate charts.
    """
    phase = record["phase"]
    return {
        f"{phase}/{key}": float(value)
        for key, value in record.items()
        if key not in _AXIS_KEYS and isinstance(value, int | float) and not isinstance(value, bool)
    }


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"grpo.steps": 200, ...}`` (for trackers with flat parameters)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_config(value, name + "."))
        else:
            flat[name] = value
    return flat


class Tracker(Protocol):
    """One tracker's run: opened (or reopened) at construction, then fed steps."""

    #: True when the tracker can drop what it logged past the resumed step (TensorBoard);
    #: append-only trackers are not sent steps they already hold.
    rewinds: bool

    def identity(self) -> dict[str, Any]:
        """What reopens this run on resume (kept in ``tracking.json``)."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self, *, failed: bool) -> None: ...


@dataclass
class RunInfo:
    """What every tracker needs to open its run."""

    run_dir: Path
    project: str
    run_name: str
    config: dict[str, Any]
    start_step: int  # the first step this process runs (0 for a new run)
    previous: dict[str, Any] | None  # this tracker's entry in tracking.json, if it has one


# Each tracker besides metrics.jsonl: the package it needs and the class that writes to it.
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard_tracker", "TensorBoardTracker"),
    "wandb": ("wandb", "wandb_tracker", "WandbTracker"),
    "mlflow": ("mlflow", "mlflow_tracker", "MlflowTracker"),
}


def check_installed(backends: list[str]) -> None:
    """Raise an ImportError naming the ``tracking`` extra for a tracker that is not installed."""
    for name in backends:
        if name in TRACKERS:
            require(TRACKERS[name][0], EXTRA, purpose=f"the {name} logger")


def _open(name: str, info: RunInfo) -> Tracker:
    _, module, cls = TRACKERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(info)


class RunTrackers:
    """The run's trackers: opens them, sends each step to each exactly once, closes them."""

    def __init__(
        self,
        backends: list[str],
        run_dir: Path,
        *,
        project: str,
        run_name: str,
        config: dict[str, Any],
        start_step: int,
        history: list[dict[str, Any]],
    ) -> None:
        """``start_step`` is the first step this process runs (0 for a new run); ``history`` the
        records of earlier steps (``metrics.jsonl`` up to the resumed step)."""
        check_installed(backends)
        self._path = run_dir / TRACKING_FILE
        saved = self._read() if start_step > 0 else {}
        self._trackers: dict[str, Tracker] = {}
        self._last: dict[str, int] = {}
        self._state: dict[str, Any] = dict(saved)  # trackers not used now keep their entries
        try:
            for name in backends:
                if name not in TRACKERS:
                    continue
                previous = saved.get(name)
                info = RunInfo(
                    run_dir,
                    project=project,
                    run_name=run_name,
                    config=config,
                    start_step=start_step,
                    previous=previous,
                )
                try:
                    tracker = _open(name, info)
                except Exception as exc:  # e.g. wandb online without an API key
                    raise ValueError(
                        f"logging.backends: {name} could not open its run: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                self._trackers[name] = tracker
                seen = previous["last_step"] if previous else -1
                if tracker.rewinds:
                    seen = min(seen, start_step - 1)
                self._last[name] = seen
                self._state[name] = {**tracker.identity(), "last_step": seen}
                for record in history:
                    if seen < record["step"] < start_step:
                        self._send(name, record)
        except BaseException:
            self.close(failed=True)
            raise
        self._write()

    @property
    def names(self) -> list[str]:
        return list(self._trackers)

    def log(self, record: dict[str, Any]) -> None:
        """Send one step's record to every tracker that does not hold that step yet."""
        for name in self._trackers:
            if record["step"] > self._last[name]:
                self._send(name, record)
        self._write()

    def close(self, *, failed: bool = False) -> None:
        for tracker in self._trackers.values():
            tracker.close(failed=failed)
        self._trackers = {}

    def _send(self, name: str, record: dict[str, Any]) -> None:
        self._trackers[name].log(record["step"], tracked_scalars(record))
        self._last[name] = record["step"]
        self._state[name]["last_step"] = record["step"]

    def _read(self) -> dict[str, Any]:
        return json.loads(self._path.read_text()) if self._path.exists() else {}

    def _write(self) -> None:
        temporary = self._path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self._state, indent=2))
        temporary.replace(self._path)
