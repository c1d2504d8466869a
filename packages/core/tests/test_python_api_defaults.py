"""The Python API logs like smalti-train by default, and fit() hands back the final metrics."""

import os

import pytest
import torch

from smalti.core import Callback, FitResult, Trainer
from smalti.core.callbacks import ProgressBar
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl


def make_trainer(max_duration="4ba", **kw):
    torch.manual_seed(0)
    loader = build_dataloader(SyntheticRegression(64), 8, seed=3)
    return Trainer(MLPRegressor(), loader, max_duration, **kw)


def plugins_of(trainer):
    return [p for p in trainer.pm.get_plugins() if not isinstance(p, type(os))]  # run plugins, not modules


def test_default_run_prints_writes_metrics_jsonl_and_points_latest(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMALTI_RUN_NAME", raising=False)
    trainer = make_trainer()
    assert any(isinstance(p, ProgressBar) for p in plugins_of(trainer))
    result = trainer.fit()
    run_dir = tmp_path / "outputs" / trainer.state.run_name
    losses = [r["metrics"]["loss/train/total"] for r in read_jsonl(run_dir / "metrics.jsonl")
              if "loss/train/total" in r["metrics"]]
    assert len(losses) == 4
    assert (tmp_path / "outputs" / "latest").resolve() == run_dir.resolve()
    out = capsys.readouterr().out
    assert "[batch 4 4/4ba] loss/train/total:" in out  # the console logger, as smalti-train prints
    assert result.metrics["loss/train/total"] == pytest.approx(losses[-1])


def test_loggers_and_progress_bar_can_be_switched_off(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(loggers=[], progress_bar=False)
    assert not any(isinstance(p, ProgressBar) for p in plugins_of(trainer))
    result = trainer.fit()
    assert not (tmp_path / "outputs").exists()
    assert capsys.readouterr().out == ""
    assert "loss/train/total" in result.metrics  # the final metrics do not need a logger


def test_given_progress_bar_and_output_dir_are_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bar = ProgressBar(refresh_every=2)
    trainer = make_trainer(callbacks=[bar], output_dir=tmp_path / "mine")
    bars = [p for p in plugins_of(trainer) if isinstance(p, ProgressBar)]
    trainer.fit()
    assert bars == [bar]  # not a second one
    assert (tmp_path / "mine" / "metrics.jsonl").exists()
    assert not (tmp_path / "outputs").exists()  # a folder the caller chose is not the CLI's latest run


def test_fit_returns_last_value_of_each_metric_and_reads_like_the_state(tmp_path):
    class LogTwice(Callback):
        def on_batch_end(self, state, logger):
            logger.log_metrics({"custom/step": float(state.timestamp.batch)})

    path = tmp_path / "m.jsonl"
    eval_loader = build_dataloader(SyntheticRegression(16, seed=1), 8, shuffle=False)
    trainer = make_trainer("6ba", loggers=[JSONLLogger(str(path))], callbacks=[LogTwice()], progress_bar=False,
                           eval_dataloader=eval_loader, eval_interval="3ba")
    result = trainer.fit()
    assert isinstance(result, FitResult)
    last = {}
    for record in read_jsonl(path):
        last.update(record["metrics"])
    assert result.metrics == last
    assert result.metrics["custom/step"] == 6.0
    assert any(k.startswith("metrics/eval/") for k in result.metrics)
    assert result.loss == result.metrics["loss/train/total"]
    # What fit() returned before: the State, still reachable and read through.
    assert result.state is trainer.state
    assert result.timestamp.batch == 6
    assert float(result.batch_loss) == pytest.approx(result.loss)
