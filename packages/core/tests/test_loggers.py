"""Loggers as a user sees them: values land in MLflow, W&B, JSONL and the console, and never block a step."""

import logging
import time

import pytest

from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import ConsoleLogger, JSONLLogger, read_jsonl
from smalti.testing import free_port


def fit(loggers, duration="6ba", config=None, callbacks=None):
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(64), 16), duration, loggers=loggers,
            callbacks=callbacks, config=config, eval_interval="3ba",
            eval_dataloader=build_dataloader(SyntheticRegression(32, seed=1), 16, shuffle=False)).fit()


def test_jsonl_logger_records_every_step_and_config(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    fit({"jsonl": JSONLLogger(str(path))}, config={"optimizer": {"lr": 0.001}})
    records = read_jsonl(path)
    train = [r for r in records if "loss/train/total" in r["metrics"]]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    evals = [r for r in records if "metrics/eval/MSE" in r["metrics"]]
    assert [r["step"] for r in evals] == [3, 6]
    assert read_jsonl(path, kind="hparams")[0]["params"] == {"optimizer": {"lr": 0.001}}


def test_console_logger_prints_on_interval(capsys):
    fit({"console": ConsoleLogger(log_interval="2ba")})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[batch")]
    assert [line.split()[1] for line in lines] == ["2", "4", "6"]
    assert all("loss/train/total" in line for line in lines)


def test_mlflow_logger_against_real_server(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from smalti.core.loggers import MLflowLogger

    artifact = tmp_path / "notes.txt"
    artifact.write_text("hello")

    class Artifact:
        def on_fit_end(self, logger):
            logger.log_artifact(str(artifact), "notes.txt")

    from smalti.core import Callback

    class ArtifactCallback(Artifact, Callback):
        pass

    logger = MLflowLogger(tracking_uri=mlflow_server.tracking_uri, experiment_name="smalti-test", run_name="mlf")
    fit({"mlflow": logger}, duration="8ba", config={"optimizer": {"lr": 0.01}, "seed": 3},
        callbacks={"artifact": ArtifactCallback()})
    assert logger.failures == 0
    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlf"
    assert run.data.params == {"optimizer.lr": "0.01", "seed": "3"}
    history = client.get_metric_history(logger.run_id, "loss/train/total")
    assert sorted(m.step for m in history) == list(range(1, 9))
    assert [m.step for m in client.get_metric_history(logger.run_id, "metrics/eval/MSE")] == [3, 6, 8]
    assert [a.path for a in client.list_artifacts(logger.run_id)] == ["notes.txt"]


def test_mlflow_unreachable_never_blocks_or_fails_training(caplog):
    from smalti.core.loggers import MLflowLogger

    dead = f"http://127.0.0.1:{free_port()}"
    logger = MLflowLogger(tracking_uri=dead, close_timeout_s=2)
    caplog.set_level(logging.WARNING)
    start = time.perf_counter()
    for step in range(2000):
        logger.log_metrics({"loss": 1.0 / (step + 1)}, step)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 2e-4  # queued, not sent on the caller's thread
    logger.close()
    assert "MLflowLogger could not connect" in caplog.text or logger.failures == 0


def test_wandb_offline_run_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from smalti.core.loggers import WandBLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandBLogger(project="smalti-test", name="offline-run", dir=str(tmp_path))
    fit({"wandb": logger}, config={"optimizer": {"lr": 0.02}})
    assert logger.failures == 0
    from smalti.testing.wandb_files import config, history

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = history(run_file)
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all("loss/train/total" in row for row in rows)
    assert [row["_step"] for row in rows if "metrics/eval/MSE" in row] == [3, 6]
    assert config(run_file)["optimizer"] == {"lr": 0.02}


def test_logger_failure_is_reported_not_raised(caplog):
    from smalti.core.loggers import QueuedLoggerDestination

    class Broken(QueuedLoggerDestination):
        def _send(self, items):
            raise ConnectionError("network down")

    broken = Broken(flush_interval_s=0.05)
    caplog.set_level(logging.WARNING)
    fit({"broken": broken})
    assert broken.failures >= 1
    assert "Broken could not send" in caplog.text and "network down" in caplog.text
