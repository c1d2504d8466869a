"""Register the trained model in MLflow's model registry when the MLflow logger is on.

At the end of training the model is written as a folder (:func:`smalti.llm.export.save_model_folder`: a
Hugging Face Llama folder for Llama-shaped models, smalti's own layout otherwise, with the tokenizer), logged
as an artifact of the MLflow logger's run, and registered as a new version of a registered model whose
source is that artifact. When the run has an ``hf_export`` callback, the folder it writes is the one logged
(one export, not two). With ``interval=N``, every Nth checkpoint the run saves is registered too, as the
model at that step (artifact ``<artifact_path>/ep<e>-ba<b>``, version tag ``step``), so a long run's
registry holds its checkpoints, not just its final model. Without an MLflow logger in the run it does nothing.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from smalti.core import Callback, distributed
from smalti.core.config.types import NonNegativeFloat, PositiveInt
from smalti.llm.choices import EXPORT_DTYPES

log = logging.getLogger(__name__)


def find_mlflow_logger(state: Any) -> Any:
    """The run's :class:`smalti.core.loggers.mlflow.MLflowLogger`, or ``None`` when the run has none."""
    manager = getattr(state, "plugin_manager", None)
    if manager is None:
        return None
    try:
        from smalti.core.loggers.mlflow import MLflowLogger
    except ImportError:  # pragma: no cover - core always ships it
        return None
    for plugin in manager.get_plugins():
        if isinstance(plugin, MLflowLogger):
            return plugin
    return None


class MLflowModelRegistry(Callback):
    """At fit end, log the model to the MLflow logger's run and register it as a model version.

    Args:
        registered_model_name: the registered model (created when missing); default: the run name.
        artifact_path: where in the run's artifacts the model folder goes.
        tokenizer: name or path of the tokenizer copied beside the weights (``None``: none).
        dtype: weights' dtype in the folder (``float32``, ``bfloat16``, ``float16``).
        wait_s: how long to wait for the logger to have created its run (it does so in the background).
        interval: also register every ``interval``-th checkpoint the run saves (``None``: the final model only).
    """

    def __init__(self, registered_model_name: str | None = None, artifact_path: str = "model",
                 tokenizer: str | None = "default", dtype: Literal[EXPORT_DTYPES] = "float32",  # type: ignore[valid-type]
                 wait_s: NonNegativeFloat = 60.0, interval: PositiveInt | None = None) -> None:
        if interval is not None and int(interval) < 1:
            raise ValueError(f"callbacks.mlflow_model.interval={interval}: give a number of checkpoints >= 1")
        self.registered_model_name = registered_model_name
        self.artifact_path = artifact_path
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.wait_s = wait_s
        self.interval = int(interval) if interval is not None else None
        #: The registered ``(name, version)`` once done (rank 0): the newest.
        self.registered: tuple[str, str] | None = None
        self._checkpoints = 0
        self._registered_at: int | None = None  # the batch of the newest registration (on every rank)

    def on_batch_checkpoint(self, state: Any) -> None:
        self._on_checkpoint(state)

    def on_epoch_checkpoint(self, state: Any) -> None:
        self._on_checkpoint(state)

    def _on_checkpoint(self, state: Any) -> None:
        if self.interval is None or not state.checkpoint_requested:
            return
        self._checkpoints += 1
        if self._checkpoints % self.interval or self._registered_at == state.timestamp.batch:
            return
        ts = state.timestamp
        self._register_plain(state, f"{self.artifact_path}/ep{ts.epoch}-ba{ts.batch}")
        self._registered_at = ts.batch  # on every rank: all of them decide alike at fit end

    def on_fit_end(self, state: Any) -> None:
        if self._registered_at == state.timestamp.batch:
            return  # the last checkpoint, at this very step, is registered already
        mlflow_logger = find_mlflow_logger(state)
        if mlflow_logger is None:
            return
        from smalti.llm.hf.callback import find_hf_export

        hf_export = find_hf_export(state)
        if hf_export is not None:
            folder = hf_export.export(state)  # collective under FSDP; written once even if hf_export runs later
            if folder is None or distributed.get_rank() != 0:
                return
            run_id = self._run_id(mlflow_logger)
            if run_id is not None:
                name = self.registered_model_name or state.run_name
                self.registered = self.register_folder(folder, mlflow_logger.tracking_uri, run_id, name,
                                                       step=state.timestamp.batch)
                log.info("registered model %r version %s in MLflow (run %s)", name, self.registered[1], run_id)
            return
        self._register_plain(state, self.artifact_path)

    def _register_plain(self, state: Any, artifact_path: str) -> None:
        """Write the model in its own folder and register it under ``artifact_path`` (collective under FSDP)."""
        from smalti.llm.model.copies import full_state_dict, plain_copy
        from smalti.llm.model.transformer import LLM

        mlflow_logger = find_mlflow_logger(state)
        if mlflow_logger is None:
            return
        model = state.raw_model
        if not isinstance(model, LLM):
            log.warning("MLflowModelRegistry: the model is a %s, not a smalti-llm LLM; not registered",
                        type(model).__name__)
            return
        weights = full_state_dict(model)  # collective under FSDP: every rank takes part
        if distributed.get_rank() != 0:
            return
        run_id = self._run_id(mlflow_logger)
        if run_id is None:
            return
        name = self.registered_model_name or state.run_name
        self.registered = self.register(plain_copy(model, weights), mlflow_logger.tracking_uri, run_id, name,
                                        artifact_path=artifact_path, step=state.timestamp.batch)
        log.info("registered model %r version %s at batch %d in MLflow (run %s)", name, self.registered[1],
                 state.timestamp.batch, run_id)

    def _run_id(self, mlflow_logger: Any) -> str | None:
        run_id = self._wait_for_run(mlflow_logger)
        if run_id is None:
            log.warning("MLflowModelRegistry: the MLflow logger has no run after %.0f s (server unreachable?); "
                        "the model was not registered", self.wait_s)
        return run_id

    def _wait_for_run(self, mlflow_logger: Any) -> str | None:
        deadline = time.monotonic() + self.wait_s
        mlflow_logger.flush(timeout=self.wait_s)
        while mlflow_logger.run_id is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return mlflow_logger.run_id

    def register(self, model: Any, tracking_uri: str | None, run_id: str, name: str,
                 artifact_path: str | None = None, step: int | None = None) -> tuple[str, str]:
        """Log ``model`` under ``artifact_path`` (default: :attr:`artifact_path`) of run ``run_id`` and register
        it as a version of ``name``."""
        from smalti.llm.export import save_model_folder

        with tempfile.TemporaryDirectory() as tmp:
            folder = save_model_folder(model, Path(tmp) / "model", tokenizer=self.tokenizer, dtype=self.dtype)
            return self.register_folder(folder, tracking_uri, run_id, name, artifact_path, step)

    def register_folder(self, folder: Path, tracking_uri: str | None, run_id: str, name: str,
                        artifact_path: str | None = None, step: int | None = None) -> tuple[str, str]:
        """Log the model ``folder`` under ``artifact_path`` (default: :attr:`artifact_path`) of run ``run_id``
        and register it as a version of ``name``, tagged with the batch ``step`` it was taken at."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        artifact_path = artifact_path or self.artifact_path
        client = MlflowClient(tracking_uri=tracking_uri)
        client.log_artifacts(run_id, str(folder), artifact_path=artifact_path)
        try:
            client.create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
        tags = {"step": str(step)} if step is not None else None
        version = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
        return name, str(version.version)
