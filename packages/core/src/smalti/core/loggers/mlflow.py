"""Sends metrics, parameters and artifacts to an MLflow tracking server, from a background thread."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from smalti.core.errors import ConfigError
from smalti.core.loggers.queued import QueuedLoggerDestination, flatten_params
from smalti.core.redact import redact, redact_url

# Limits of one MLflow ``log_batch`` request and of a parameter value.
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000
_BAD_KEY_CHARS = re.compile(r"[^\w\-. :/]")
# Server answers that mean "try again later"; any other answer from the server is a rejection.
_RETRYABLE_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED"}


def _require(module: str, what: str, install: str) -> None:
    try:
        __import__(module)
    except ImportError:
        raise ConfigError(f"{what} needs {module}, which is not installed: {install}") from None


def mlflow_key(name: str) -> str:
    """``name`` with the characters MLflow rejects in metric and parameter names replaced by ``_``."""
    return _BAD_KEY_CHARS.sub("_", name)


class MLflowLogger(QueuedLoggerDestination):
    """An MLflow run on rank 0. Metrics go in batches: one ``log_batch`` request per up to 1000 metrics.

    The experiment and run are created on the sender thread, so an unreachable server delays nothing;
    while it is down, entries wait (bounded, oldest dropped first) and are retried with back-off. How long
    one attempt waits is mlflow's own setting (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._TIMEOUT``).

    Args:
        tracking_uri: server address; default ``$MLFLOW_TRACKING_URI`` (else mlflow's default, ``./mlruns``).
        experiment_name: created if it does not exist.
        run_name: default: the trainer's run name.
        tags: run tags (credentials in them are redacted, as in every logged config).
        log_system_metrics: also record CPU/GPU/memory use with mlflow's system-metrics monitor (needs psutil).
        system_metrics_interval_s: sampling interval of that monitor.
        **kwargs: queue settings of :class:`~smalti.core.loggers.queued.QueuedLoggerDestination`.
    """

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "smalti", run_name: str | None = None,
                 tags: dict[str, str] | None = None, log_system_metrics: bool = False,
                 system_metrics_interval_s: float = 10.0, flush_interval_s: float = 1.0, **kwargs: Any) -> None:
        _require("mlflow", "the MLflow logger (logger=mlflow)", "pip install 'smalti-core[mlflow]'")
        if log_system_metrics:
            _require("psutil", "log_system_metrics=true", "pip install psutil (or set log_system_metrics=false)")
        super().__init__(flush_interval_s=flush_interval_s, **kwargs)
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in redact(dict(tags or {})).items()}  # tags are logged: no secrets
        self.log_system_metrics = log_system_metrics
        self.system_metrics_interval_s = system_metrics_interval_s
        #: The MLflow run id, set once the sender thread has created the run.
        self.run_id: str | None = None
        self._client: Any = None
        self._experiment_id: str | None = None
        self._monitor: Any = None

    def on_init(self, state: Any) -> None:
        if self.run_name is None:
            self.run_name = state.run_name

    def _start(self) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment_name)
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self._client, self.run_id, self._experiment_id = client, run.info.run_id, experiment_id
        if self.log_system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.system_metrics_interval_s,
                                                 tracking_uri=self.tracking_uri)
            self._monitor.start()

    def _send(self, items: list[Any]) -> None:
        from mlflow.entities import Metric, Param

        metrics: list[Metric] = []
        params: dict[str, str] = {}
        artifacts: list[tuple[str, str]] = []
        for item in items:
            if item[0] == "metrics":
                _, step, values, when = item
                ms = int(when * 1000)
                metrics.extend(Metric(mlflow_key(k), float(v), ms, int(step)) for k, v in values.items())
            elif item[0] == "params":
                params.update({mlflow_key(k)[:250]: str(v)[:_MAX_PARAM_VALUE]
                               for k, v in flatten_params(item[1]).items()})
            elif item[0] == "artifact":
                artifacts.append((item[1], item[2]))
        param_list = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(param_list), _MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=param_list[i : i + _MAX_PARAMS_PER_BATCH])
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH])
        for local_path, name in artifacts:
            self._log_artifact(local_path, name)

    def _log_artifact(self, local_path: str, name: str) -> None:
        folder, filename = os.path.split(name)
        if filename == os.path.basename(local_path) or os.path.isdir(local_path):
            self._client.log_artifact(self.run_id, local_path, artifact_path=folder or None)
            return
        with tempfile.TemporaryDirectory() as tmp:  # MLflow names the artifact after the file: copy to rename
            renamed = os.path.join(tmp, filename)
            shutil.copyfile(local_path, renamed)
            self._client.log_artifact(self.run_id, renamed, artifact_path=folder or None)

    def _finish(self, status: str) -> None:
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        if self._client is not None and self.run_id is not None:
            shown = redact_url(self.tracking_uri or "")
            if shown == (self.tracking_uri or ""):
                self._client.set_terminated(self.run_id, status=status)
                return
            # MLflow prints the run's link with the tracking URI as given, password included: print it redacted.
            with _env("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true"):
                self._client.set_terminated(self.run_id, status=status)
            experiment_url = f"{shown.rstrip('/')}/#/experiments/{self._experiment_id}"
            sys.stdout.write(f"View run {self.run_name} at: {experiment_url}/runs/{self.run_id}\n")

    def _is_transient(self, exc: BaseException) -> bool:
        from mlflow.exceptions import MlflowException

        # No answer (refused, reset, time-out) comes as INTERNAL_ERROR too; a rejection of the data as
        # INVALID_PARAMETER_VALUE and the like, which retrying cannot fix.
        if isinstance(exc, MlflowException):
            return exc.error_code in _RETRYABLE_CODES
        return isinstance(exc, OSError)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the duration of the block."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
