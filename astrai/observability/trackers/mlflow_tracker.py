"""MLflow: a local file store under `<output_dir>/mlruns` unless `runtime.mlflow_tracking_uri` names another.

The run's params are the resolved job, flattened to dotted keys (`train.lr`). MLflow never changes a param
once logged, so a resume whose job differs keeps the first values and names the changed keys in one warning.
MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is set: a `file:` URI sets it (for this
process only) when the environment has not. `mlflow ui --backend-store-uri <output_dir>/mlruns` shows it
(the UI needs the full `mlflow` package; the extra installs `mlflow-skinny`, the client alone).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from astrai.observability.trackers.base import Tracker, flatten, run_name, tracked_config

logger = logging.getLogger("astrai.trackers")

BATCH = 100  # the most params or metrics one log_batch request may carry on an MLflow server
PARAM_LENGTH = 6000  # MLflow's limit on a param value


def tracking_uri(job, output_dir: Path) -> str:
    return job.runtime.mlflow_tracking_uri or (Path(output_dir).resolve() / "mlruns").as_uri()


class MlflowTracker(Tracker):
    name = "mlflow"

    def start(self, job, output_dir: Path, start_step: int, saved: dict | None) -> dict:
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(job, output_dir)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(uri)
        if saved and saved.get("tracking_uri") == uri:
            run = client.get_run(saved["run_id"])
            client.update_run(run.info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            experiment = client.get_experiment_by_name(job.runtime.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(job.runtime.mlflow_experiment)
            )
            run = client.create_run(
                experiment_id, run_name=run_name(output_dir), tags={"astrai.output_dir": str(output_dir)}
            )
        self._run_id = run.info.run_id
        params = {key: value[:PARAM_LENGTH] for key, value in flatten(tracked_config(job)).items()}
        logged = run.data.params
        changed = sorted(key for key, value in params.items() if key in logged and logged[key] != value)
        if changed:
            logger.warning("mlflow keeps a run's first params; the resumed job changed %s", ", ".join(changed))
        fresh = [Param(key, value) for key, value in params.items() if key not in logged]
        for first in range(0, len(fresh), BATCH):
            client.log_batch(self._run_id, params=fresh[first : first + BATCH])
        logger.info("mlflow run %s at %s", self._run_id, uri)
        return {"run_id": self._run_id, "tracking_uri": uri}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(key, value, now, step) for key, value in metrics.items()]
        for first in range(0, len(points), BATCH):
            self._client.log_batch(self._run_id, metrics=points[first : first + BATCH])

    def finish(self, failed: bool) -> None:
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")
