"""Sends metrics, parameters and artifacts to an MLflow tracking server, from a background thread."""

from __future__ import annotations

import os
from typing import Any

from smalti.core.errors import ConfigError
from smalti.core.loggers.queued import QueuedLoggerDestination, flatten_params

_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100


class MLflowLogger(QueuedLoggerDestination):
    """An MLflow run on rank 0. Metrics go in batches (one ``log_batch`` request per batch, not per metric).

    The experiment and run are created on the sender thread, so an unreachable server delays nothing.
    ``tracking_uri`` defaults to ``$MLFLOW_TRACKING_URI``.
    """

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "smalti", run_name: str | None = None,
                 tags: dict[str, str] | None = None, flush_interval_s: float = 1.0, **kwargs: Any) -> None:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise ConfigError("the MLflow logger needs mlflow: pip install 'smalti-core[mlflow]'") from None
        super().__init__(flush_interval_s=flush_interval_s, **kwargs)
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None

    def on_init(self, state: Any) -> None:
        if self.run_name is None:
            self.run_name = state.run_name

    def _start(self) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment_name)
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self._client, self.run_id = client, run.info.run_id

    def _send(self, items: list[Any]) -> None:
        from mlflow.entities import Metric, Param

        metrics: list[Metric] = []
        params: dict[str, str] = {}
        for item in items:
            if item[0] == "metrics":
                _, step, values, when = item
                ms = int(when * 1000)
                metrics.extend(Metric(k, float(v), ms, step) for k, v in values.items())
            elif item[0] == "params":
                params.update({k: str(v)[:6000] for k, v in flatten_params(item[1]).items()})
            elif item[0] == "artifact":
                self._client.log_artifact(self.run_id, item[1], artifact_path=os.path.dirname(item[2]) or None)
        param_list = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(param_list), _MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=param_list[i : i + _MAX_PARAMS_PER_BATCH])
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH])

    def _finish(self, status: str) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, status=status)
