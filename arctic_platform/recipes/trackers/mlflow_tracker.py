"""MLflow through ``MlflowClient``: a local ``file:`` store under the run directory by default.

``MLFLOW_TRACKING_URI`` (read by MLflow's own settings) points elsewhere, e.g. a tracking server
or ``sqlite:///mlflow.db``. MLflow 3 keeps its file store in maintenance mode and refuses it
unless ``MLFLOW_ALLOW_FILE_STORE`` is true; for a ``file:`` store that variable defaults to true
here (set it to false to get MLflow's refusal).
The experiment is ``logging.project``; the recipe config goes in as flat parameters
(``grpo.steps``) and as the ``recipe.json`` artifact. A resumed run reopens the same MLflow run id.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any
from urllib.parse import urlparse

from arctic_platform.recipes.trackers import RunInfo, flat_config

STORE_DIR = "mlruns"
# MLflow's limits: a parameter value's length, parameters in one log_batch call.
MAX_PARAM_LENGTH = 6000
MAX_PARAMS_PER_BATCH = 100


class MlflowTracker:
    rewinds = False

    def __init__(self, info: RunInfo) -> None:
        from mlflow.environment_variables import MLFLOW_TRACKING_URI
        from mlflow.tracking import MlflowClient

        if info.previous:
            self.tracking_uri = info.previous["tracking_uri"]
        else:
            default = (info.run_dir / STORE_DIR).resolve().as_uri()
            self.tracking_uri = MLFLOW_TRACKING_URI.get() or default
        if urlparse(self.tracking_uri).scheme == "file":
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        if info.previous:
            self.run_id = info.previous["run_id"]
            self._client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self._client.get_experiment_by_name(info.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(info.project)
        )
        run = self._client.create_run(experiment_id, run_name=info.run_name)
        self.run_id = run.info.run_id
        self._log_config(info.config)

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [
            Param(key, (value if isinstance(value, str) else json.dumps(value))[:MAX_PARAM_LENGTH])
            for key, value in flat_config(config).items()
        ]
        for first in range(0, len(params), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[first : first + MAX_PARAMS_PER_BATCH])
        self._client.log_dict(self.run_id, config, "recipe.json")

    def identity(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, *, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
