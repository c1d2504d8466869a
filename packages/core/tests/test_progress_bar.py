"""The progress bar shows the loss of the step it counts, and the last step's loss at the end."""

import re
import time

import pytest
import torch

from smalti.core import Callback, Trainer
from smalti.core.callbacks import ProgressBar
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression
from smalti.testing import MetricsRecorder


class SlowStep(Callback):
    """Makes each step outlast tqdm's 0.1 s redraw throttle, so every update() draws a frame."""

    def on_batch_start(self):
        time.sleep(0.11)


@pytest.mark.parametrize("batches,refresh_every", [(5, 1), (7, 10), (10, 5)])
def test_progress_bar_shows_the_loss_of_the_step_it_counts_and_the_last_one_at_the_end(capsys, batches,
                                                                                        refresh_every):
    torch.manual_seed(0)
    losses = MetricsRecorder()
    Trainer(MLPRegressor(), build_dataloader(SyntheticRegression(256), 16), f"{batches}ba", eval_interval=None,
            callbacks=[ProgressBar(force=True, refresh_every=refresh_every), SlowStep()], loggers={"losses": losses}).fit()
    logged = [f"{v:.4f}" for v in losses.values("loss/train/total")]
    frames = re.findall(r"(\d+)/\d+ \[[^\]]*loss=([0-9.]+)\]", capsys.readouterr().out)
    assert frames, "no frame of the bar showed a loss"
    for count, shown in frames:  # a frame at step k shows the loss of the last refresh at or before k
        step = int(count)
        refreshed = step if step == batches else step - step % refresh_every
        assert shown == logged[refreshed - 1], (count, shown, logged)
    assert frames[-1] == (str(batches), logged[-1])
