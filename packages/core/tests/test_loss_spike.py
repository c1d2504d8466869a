"""loss_spike as a user notices it: detections in metrics.jsonl, save-and-stop, and a rollback that skips the
batches that caused the spike."""

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.callbacks import LossSpike
from smalti.core.data import build_dataloader
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.core.loggers import JSONLLogger
from smalti.core.loggers.jsonl import read_jsonl


class Poison(Callback):
    """Multiplies the loss of the ``bad``-th batches drawn from the loader (1-based), whatever the step counter says."""

    def __init__(self, bad, factor=100.0):
        self.bad, self.factor, self.drawn = set(bad), factor, 0
        self.first_x = []

    def on_after_dataloader(self, state):
        self.drawn += 1
        self.first_x.append(float(state.batch[0][0, 0]))

    def on_after_loss(self, state):
        if self.drawn in self.bad:
            state.loss = state.loss * self.factor


class CheckpointEvery(Callback):
    """Stands in for a checkpointer: asks for a checkpoint every ``n`` batches and keeps the weights of each."""

    def __init__(self, n):
        self.n, self.saved, self.requested_at = n, {}, []

    def should_checkpoint(self, state):
        return state.timestamp.batch % self.n == 0 or None

    def on_batch_checkpoint(self, state):
        if state.checkpoint_requested:
            self.requested_at.append(state.timestamp.batch)
            self.saved[state.timestamp.batch] = {k: v.clone() for k, v in state.raw_model.state_dict().items()}


class Starts(Callback):
    """The step counter and weights each batch starts from (after any rollback)."""

    def __init__(self):
        self.rows = []

    def on_before_train_batch(self, state):
        self.rows.append((state.timestamp.batch, {k: v.clone() for k, v in state.raw_model.state_dict().items()}))


def fit(tmp_path, spike, duration="14ba", extra=None):
    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    callbacks = {**(extra or {}), "loss_spike": spike}
    trainer = Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(512), 16), duration,
                      optimizers=lambda p: torch.optim.SGD(p, lr=1e-3), callbacks=callbacks, eval_interval=None,
                      loggers={"jsonl": JSONLLogger(str(path))})
    trainer.fit()
    return trainer.state, read_jsonl(path)


def steps_of(rows, key):
    return [(r["step"], r["metrics"][key]) for r in rows if key in r["metrics"]]


@pytest.mark.parametrize("check_interval", ["1ba", "4ba"])
def test_a_spike_is_logged_after_patience_outliers_and_training_goes_on(tmp_path, check_interval):
    poison = Poison(bad={8, 9, 10})
    spike = LossSpike("log", window_size=4, outlier_multiplier=3, patience=1, loss_cap=None,
                      check_interval=check_interval)
    state, rows = fit(tmp_path, spike, extra={"p": poison})
    assert steps_of(rows, "loss_spike/detected") == [(9, 1.0), (10, 1.0)]  # the 2nd and 3rd outlier in a row
    assert state.timestamp.batch == 14


def test_a_high_loss_plateau_is_logged_once_the_window_is_full(tmp_path):
    _, rows = fit(tmp_path, LossSpike("log", window_size=5, loss_cap=1e-6), duration="6ba")
    assert steps_of(rows, "loss_spike/detected") == [(5, 2.0), (6, 2.0)]


def test_save_and_stop_checkpoints_the_spike_batch_and_stops(tmp_path):
    ckpt = CheckpointEvery(100)
    state, rows = fit(tmp_path, LossSpike("save_and_stop", window_size=4, outlier_multiplier=3, patience=1, loss_cap=None),
                      extra={"p": Poison(bad={8, 9}), "ckpt": ckpt})
    assert ckpt.requested_at == [9] and state.timestamp.batch == 9
    assert steps_of(rows, "loss_spike/detected") == [(9, 1.0)]


def test_rollback_restores_the_last_checkpoint_and_skips_the_batches_since(tmp_path):
    poison, ckpt, starts = Poison(bad={8, 9}), CheckpointEvery(5), Starts()
    state, rows = fit(tmp_path, LossSpike("rollback", window_size=4, outlier_multiplier=3, patience=1, loss_cap=None),
                      extra={"p": poison, "ckpt": ckpt, "starts": starts})
    # detected at batch 9; the 10th batch drawn trains as step 6 from the weights saved at batch 5
    assert steps_of(rows, "loss_spike/detected") == [(9, 1.0)]
    assert steps_of(rows, "loss_spike/rollbacks") == [(5, 1.0)]
    assert steps_of(rows, "loss_spike/skipped_batches") == [(5, 4.0)]
    step, weights = starts.rows[9]
    assert step == 5
    for name, tensor in ckpt.saved[5].items():
        assert torch.equal(weights[name], tensor), name
    # no batch is drawn twice: the data goes on after the spike, and the run still lasts 14 steps
    assert len(set(poison.first_x)) == len(poison.first_x) == 14 + 4
    assert state.timestamp.batch == 14
    assert max(v for _, v in steps_of(rows, "loss/train/total")[-4:]) < 100  # the spike is gone


def test_rollback_gives_up_after_max_rollbacks(tmp_path):
    with pytest.raises(TrainingError, match=r"max_rollbacks=0"):
        fit(tmp_path, LossSpike("rollback", window_size=4, outlier_multiplier=3, patience=1, loss_cap=None, max_rollbacks=0),
            extra={"p": Poison(bad={8, 9})})


@pytest.mark.parametrize(("kw", "key"), [
    ({"action": "kill"}, "action"), ({"window_size": 0}, "window_size"), ({"outlier_multiplier": 1.0},
                                                                            "outlier_multiplier"),
    ({"patience": -1}, "patience"), ({"check_interval": "1ep"}, "check_interval"),
])
def test_bad_options_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"callbacks\.loss_spike\.{key}"):
        LossSpike(**kw)
