"""Loggers as a user sees them: values land in MLflow, W&B, JSONL and the console, and never block a step."""

import contextlib
import logging
import socket
import threading
import time
from pathlib import Path

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


def wait_for_wandb_exit(run_file, timeout=60):
    """``run.finish()`` returns before wandb's service process has written the offline file out: wait for it."""
    from smalti.testing.wandb_files import read_records

    def finished():
        try:
            return any(r.WhichOneof("record_type") == "exit" for r in read_records(run_file))
        except Exception:  # a record still being written
            return False

    deadline = time.monotonic() + timeout
    while not finished():
        assert time.monotonic() < deadline, f"{run_file} got no exit record in {timeout} s"
        time.sleep(0.1)


def test_wandb_offline_run_files(tmp_path, monkeypatch):
    from smalti.core.loggers import WandBLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandBLogger(project="smalti-test", name="offline-run", dir=str(tmp_path))
    fit({"wandb": logger}, config={"optimizer": {"lr": 0.02}})
    assert logger.failures == 0
    from smalti.testing.wandb_files import config, history

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    wait_for_wandb_exit(run_file)
    rows = history(run_file)
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all("loss/train/total" in row for row in rows)
    assert [row["_step"] for row in rows if "metrics/eval/MSE" in row] == [3, 6]
    assert config(run_file)["optimizer"] == {"lr": 0.02}
    from smalti.testing.wandb_files import read_records

    exits = [r.exit.exit_code for r in read_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [0]  # the run was finished at close, as a success


def test_wandb_run_finishes_failed_when_training_raises(tmp_path, monkeypatch):
    from smalti.core import Callback
    from smalti.core.loggers import WandBLogger
    from smalti.testing.wandb_files import history, read_records

    class Crash(Callback):
        def on_batch_end(self, state):
            if state.timestamp.batch == 2:
                raise RuntimeError("simulated crash")

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandBLogger(project="smalti-test", name="crashed", mode="offline", dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit({"wandb": logger}, callbacks={"crash": Crash()})
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    wait_for_wandb_exit(run_file)
    assert [row["_step"] for row in history(run_file)] == [1, 2]
    exits = [r.exit.exit_code for r in read_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]


def test_logger_failure_is_reported_not_raised(caplog):
    from smalti.core.loggers import QueuedLoggerDestination

    class Broken(QueuedLoggerDestination):
        def _send(self, items):
            raise ConnectionError("network down")

    broken = Broken(flush_interval_s=0.05, close_timeout_s=1)
    caplog.set_level(logging.WARNING)
    start = time.perf_counter()
    fit({"broken": broken})
    assert time.perf_counter() - start < 15
    assert broken.failures >= 1 and broken.sent == 0 and broken.dropped > 0
    assert "Broken could not send" in caplog.text and "network down" in caplog.text


# ---------------------------------------------------------------------------------------------- MLflow


@pytest.fixture
def fail_fast_mlflow(monkeypatch):
    """mlflow's own retries would hold one attempt for minutes; the logger retries by itself instead."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


class TcpProxy:
    """Forwards a loopback port to another, so a test can make a server appear at an address later."""

    def __init__(self, port, target_port):
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", port))
        self.sockets = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=30)
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self):
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


def test_mlflow_many_steps_one_request_per_batch(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from smalti.core.loggers import MLflowLogger

    class CountingMLflowLogger(MLflowLogger):
        requests = 0

        def _start(self):
            super()._start()
            send = self._client.log_batch

            def counted(*args, **kwargs):
                self.requests += 1
                return send(*args, **kwargs)

            self._client.log_batch = counted

    report = tmp_path / "report.txt"
    report.write_text("all good")
    logger = CountingMLflowLogger(tracking_uri=mlflow_server.tracking_uri, experiment_name="smalti-many",
                                  run_name="many", tags={"team": "smalti"})
    logger.log_hyperparameters({"model": {"width": 64, "act": "gelu"}, "seed": 5})
    steps = range(1, 301)
    for step in steps:
        logger.log_metrics({"loss": 10.0 / step, "lr": step * 1e-5, "bad key!": float(step)}, step)
    logger.log_artifact(str(report), "reports/summary.txt")
    logger.on_close()
    assert logger.failures == 0 and logger.dropped == 0
    assert logger.requests <= 3  # 900 values in one or two log_batch requests (plus the params), not 900

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "many" and run.data.tags["team"] == "smalti"
    assert run.data.params == {"model.width": "64", "model.act": "gelu", "seed": "5"}
    loss = sorted(client.get_metric_history(logger.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in loss] == list(steps)
    assert [m.value for m in loss] == pytest.approx([10.0 / s for s in steps])
    assert [m.step for m in client.get_metric_history(logger.run_id, "bad key_")] == list(steps)
    assert [a.path for a in client.list_artifacts(logger.run_id, "reports")] == ["reports/summary.txt"]
    local = client.download_artifacts(logger.run_id, "reports/summary.txt", str(tmp_path))
    assert Path(local).read_text() == "all good"


def test_mlflow_run_marked_failed_when_training_raises(mlflow_server):
    from mlflow import MlflowClient

    from smalti.core import Callback
    from smalti.core.loggers import MLflowLogger

    class Crash(Callback):
        def on_batch_end(self, state):
            if state.timestamp.batch == 3:
                raise RuntimeError("simulated crash")

    logger = MLflowLogger(tracking_uri=mlflow_server.tracking_uri, experiment_name="smalti-test", run_name="crash")
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit({"mlflow": logger}, callbacks={"crash": Crash()})
    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    assert client.get_run(logger.run_id).info.status == "FAILED"
    assert sorted(m.step for m in client.get_metric_history(logger.run_id, "loss/train/total")) == [1, 2, 3]


def test_mlflow_unreachable_never_blocks_or_fails_training(fail_fast_mlflow, caplog):
    from smalti.core.loggers import MLflowLogger

    caplog.set_level(logging.WARNING)
    logger = MLflowLogger(tracking_uri=f"http://127.0.0.1:{free_port()}", close_timeout_s=2, retry_initial_s=0.2)
    calls = 2000
    start = time.perf_counter()
    for step in range(calls):
        logger.log_metrics({"loss": 1.0 / (step + 1), "lr": 1e-3}, step)
    per_call = (time.perf_counter() - start) / calls
    assert per_call < 100e-6, f"{per_call * 1e6:.1f} us per log call"  # queued, never sent on this thread

    start = time.perf_counter()
    fit({"mlflow": logger}, duration="6ba")  # training runs to the end; close gives up after close_timeout_s
    assert time.perf_counter() - start < 30
    assert logger.failures >= 1 and logger.run_id is None
    assert "MLflowLogger could not connect" in caplog.text and "Connection refused" in caplog.text
    assert "could not be sent" in caplog.text  # the loss is reported, not silent


def test_mlflow_outage_then_recovery_loses_nothing(mlflow_server, fail_fast_mlflow):
    from mlflow import MlflowClient

    from smalti.core.loggers import MLflowLogger

    port = free_port()
    logger = MLflowLogger(tracking_uri=f"http://127.0.0.1:{port}", experiment_name="smalti-outage",
                          flush_interval_s=0.1, retry_initial_s=0.1, retry_max_s=0.3)
    for step in range(50):
        logger.log_metrics({"loss": float(step)}, step)
    deadline = time.monotonic() + 20
    while logger.failures < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logger.failures >= 2 and logger.run_id is None  # down: nothing could be created yet
    proxy = TcpProxy(port, int(mlflow_server.tracking_uri.rsplit(":", 1)[1]))  # the server comes back
    try:
        for step in range(50, 80):
            logger.log_metrics({"loss": float(step)}, step)
        assert logger.flush(timeout=60)
        logger.close()
        history = MlflowClient(tracking_uri=mlflow_server.tracking_uri).get_metric_history(logger.run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(80)]
        assert logger.dropped == 0
    finally:
        proxy.close()


# ---------------------------------------------------------------------------------------------- others


def test_console_prints_config_once_and_only_on_rank_zero(capsys, monkeypatch):
    fit({"console": ConsoleLogger(log_interval=3)}, config={"optimizer": {"lr": 0.1}, "model": {}})
    out = capsys.readouterr().out
    assert out.count("[config]") == 1 and "optimizer, model" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("[batch")] == ["3", "6"]
    assert [line.split()[1] for line in out.splitlines() if line.startswith("[eval")] == ["3]", "6]"]

    monkeypatch.setenv("RANK", "1")
    quiet = ConsoleLogger(log_interval=1)
    quiet.log_hyperparameters({"a": 1})
    quiet.log_metrics({"loss/train/total": 1.0}, 1)
    assert capsys.readouterr().out == ""


def test_jsonl_unwritable_path_is_reported_not_raised(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    logger = JSONLLogger(str(blocker / "metrics.jsonl"))
    caplog.set_level(logging.WARNING)
    fit({"jsonl": logger})
    assert logger.failures >= 6 and "JSONLLogger could not write" in caplog.text


def test_jsonl_writes_tensors_and_other_ranks_stay_quiet(tmp_path, monkeypatch):
    import torch

    path = tmp_path / "m.jsonl"
    logger = JSONLLogger(str(path))
    logger.log_metrics({"loss": torch.tensor(0.25), "n": 3}, 7)
    logger.log_hyperparameters({"path": tmp_path})
    logger.on_close()
    (rec,) = read_jsonl(path)
    assert rec["step"] == 7 and rec["metrics"] == {"loss": 0.25, "n": 3} and rec["time"] > 0
    assert read_jsonl(path, kind="hparams")[0]["params"] == {"path": str(tmp_path)}

    monkeypatch.setenv("RANK", "1")
    other = JSONLLogger(str(tmp_path / "r1.jsonl"))
    other.log_metrics({"loss": 1.0}, 1)
    other.on_close()
    assert list(tmp_path.glob("r1*")) == []


def test_logger_config_group_builds_every_option(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from smalti.core.config.build import build_group
    from smalti.core.config.schema import register_configs
    from smalti.core.loggers import MLflowLogger, TensorBoardLogger, WandBLogger

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    register_configs()
    with initialize_config_module("smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=["logger=[console,jsonl,mlflow,wandb,tensorboard]", "run_name=cfg-test"],
                      return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(tmp_path)
        HydraConfig.instance().set_config(cfg)
        built = build_group(cfg.logger, "logger")
    assert list(built) == ["console", "jsonl", "mlflow", "wandb", "tensorboard"]
    assert isinstance(built["console"], ConsoleLogger) and str(built["console"].interval) == "10ba"
    assert isinstance(built["jsonl"], JSONLLogger) and built["jsonl"].path == tmp_path / "metrics.jsonl"
    assert isinstance(built["mlflow"], MLflowLogger) and built["mlflow"].tracking_uri == "http://127.0.0.1:1"
    assert built["mlflow"].run_name == "cfg-test"
    assert isinstance(built["wandb"], WandBLogger) and built["wandb"].mode == "offline"
    assert built["wandb"].name == "cfg-test" and built["wandb"].dir == str(tmp_path)
    assert isinstance(built["tensorboard"], TensorBoardLogger) and built["tensorboard"].log_dir == str(tmp_path / "tensorboard")


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_equal_the_jsonl_record(tmp_path):
    from smalti.core.loggers import TensorBoardLogger

    fit({"jsonl": JSONLLogger(str(tmp_path / "m.jsonl")), "tb": TensorBoardLogger(str(tmp_path / "tb"))},
        config={"optimizer": {"lr": 0.001, "password": "hunter2"}})
    scalars = _tensorboard_scalars(tmp_path / "tb")
    records = read_jsonl(tmp_path / "m.jsonl")
    expected = [r["metrics"]["loss/train/total"] for r in records if "loss/train/total" in r["metrics"]]
    assert [step for step, _ in scalars["loss/train/total"]] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in scalars["loss/train/total"]] == pytest.approx(expected, rel=1e-6)  # float32
    assert [step for step, _ in scalars["metrics/eval/MSE"]] == [3, 6]
    text = b"".join(p.read_bytes() for p in (tmp_path / "tb").iterdir())
    assert b"0.001" in text and b"hunter2" not in text  # hyperparameters as text, credentials redacted


def test_tensorboard_from_the_command_line_writes_in_the_run_folder(tmp_path):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "smalti.core.cli.train", "model=mlp", "data=synthetic", "trainer.max_duration=3ba",
           "trainer.eval_interval=null", "callbacks=[]", "logger=[tensorboard]", "run_name=tb-run"]
    out = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    scalars = _tensorboard_scalars(tmp_path / "outputs" / "tb-run" / "tensorboard")
    assert [step for step, _ in scalars["loss/train/total"]] == [1, 2, 3]
