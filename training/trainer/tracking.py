"""MLflow tracking when MLFLOW_TRACKING_URI is set; a restarted run continues the same MLflow
run (its id travels in the checkpoint). Rank 0 only; mlflow is an optional extra."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("gts.tracking")


class Tracker:
    def __init__(self, enabled: bool, run_id: str | None, params: dict[str, Any]):
        self.mlflow: Any = None
        self.run_id = run_id
        if not enabled or not os.environ.get("MLFLOW_TRACKING_URI"):
            return
        try:
            import mlflow
        except ImportError:
            log.warning("MLFLOW_TRACKING_URI is set but mlflow is not installed; tracking is off")
            return
        self.mlflow = mlflow
        run = mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run()
        self.run_id = run.info.run_id
        if not run_id:
            mlflow.log_params({k: v for k, v in params.items() if v not in ("", None)})

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.mlflow is not None:
            self.mlflow.log_metrics(values, step=step)

    def close(self, interrupted: bool = False) -> None:
        """End the MLflow run: KILLED when a signal stopped training (a restart reopens it)."""
        if self.mlflow is not None:
            self.mlflow.end_run(status="KILLED" if interrupted else "FINISHED")
