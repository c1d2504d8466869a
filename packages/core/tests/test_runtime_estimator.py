"""runtime_estimator as a user reads it from metrics.jsonl: an estimate of the time left that comes true, with
evaluation and checkpoint time counted apart."""

import time

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.callbacks import RuntimeEstimator
from smalti.core.callbacks.runtime_estimator import format_seconds
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl

STEP_S, EVAL_S, CKPT_S = 0.03, 0.15, 0.25


class Slow(Callback):
    """Makes a step, an evaluation round and a checkpoint take known times; checkpoints every 6 batches; and
    records what each step really took (longer than the sleep on a loaded machine)."""

    def __init__(self):
        self.steps, self.evals = [], []

    def on_batch_start(self, state):
        self._t0 = time.perf_counter()

    def on_after_optimizer_step(self, state):
        self.steps.append(time.perf_counter() - self._t0)

    def on_after_forward(self, state):
        time.sleep(STEP_S)

    def on_eval_before_all(self, state):
        self._e0 = time.perf_counter()

    def on_eval_start(self, state):
        time.sleep(EVAL_S)

    def on_eval_after_all(self, state):
        self.evals.append(time.perf_counter() - self._e0)

    def should_checkpoint(self, state):
        return state.timestamp.batch % 6 == 0 or None

    def on_batch_checkpoint(self, state):
        if state.checkpoint_requested:
            time.sleep(CKPT_S)


def test_the_estimate_comes_true_and_eval_and_checkpoint_time_are_counted_apart(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    slow = Slow()
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(512), 16), "24ba",
            optimizers=lambda p: torch.optim.SGD(p, lr=1e-3), eval_interval="8ba",
            eval_dataloader=build_dataloader(SyntheticRegression(16, seed=1), 16, shuffle=False),
            callbacks={"slow": slow, "runtime_estimator": RuntimeEstimator(interval="4ba")},
            loggers={"jsonl": JSONLLogger(str(path))}).fit()
    rows = [r for r in read_jsonl(path) if "wall_clock/train" in r["metrics"]]
    assert [r["step"] for r in rows] == [4, 8, 12, 16, 20, 24]
    last = rows[-1]["metrics"]
    assert len(slow.evals) == 3 and sum(slow.evals) >= 3 * EVAL_S  # at batches 8, 16, 24
    assert last["wall_clock/eval"] == pytest.approx(sum(slow.evals), rel=0.3)
    assert last["wall_clock/checkpoint"] == pytest.approx(4 * CKPT_S, rel=0.3)  # at 6, 12, 18, 24
    assert len(slow.steps) == 24 and sum(slow.steps) >= 24 * STEP_S
    assert last["wall_clock/train"] == pytest.approx(sum(slow.steps), rel=0.4)
    assert last["wall_clock/remaining_estimate"] == pytest.approx(0.0, abs=1e-9)
    # at step 12, the estimate against what the rest of the run then took (12 steps, 2 evals, 2 checkpoints)
    at12 = next(r for r in rows if r["step"] == 12)
    actual = rows[-1]["time"] - at12["time"]
    assert at12["metrics"]["wall_clock/remaining_estimate"] == pytest.approx(actual, rel=0.3)
    # a rate that mixed evaluation and checkpoints into the step time would say far more than the steps alone
    assert at12["metrics"]["wall_clock/remaining_estimate"] > 12 * STEP_S + 2 * EVAL_S


def test_the_estimate_is_on_the_progress_bar(tmp_path, capsys):
    from smalti.core.callbacks import ProgressBar

    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(256), 16), "6ba", eval_interval=None,
            callbacks={"progress_bar": ProgressBar(force=True, refresh_every=1),
                       "runtime_estimator": RuntimeEstimator(interval="2ba", skip_batches=0)}).fit()
    assert " eta 0:00:0" in capsys.readouterr().out


def test_format_seconds():
    assert format_seconds(3723.4) == "1:02:03" and format_seconds(float("nan")) == "?"


@pytest.mark.parametrize(("kw", "key"), [({"interval": "1ep"}, "interval"), ({"interval": "x"}, "interval"),
                                         ({"window_size": 0}, "window_size")])
def test_bad_options_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"callbacks\.runtime_estimator\.{key}"):
        RuntimeEstimator(**kw)
