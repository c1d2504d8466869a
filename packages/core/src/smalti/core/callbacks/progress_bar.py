"""A tqdm progress bar on rank 0, off when output is not a terminal."""

from __future__ import annotations

import sys
from typing import Any

from smalti.core.config.types import PositiveInt
from smalti.core.errors import TimeError
from smalti.core.plugins import Callback


class ProgressBar(Callback):
    """Shows batches done out of ``max_duration`` and the loss (refreshed every ``refresh_every`` batches and at
    the end of the run, so the last line holds the last step's loss).

    Only rank 0 draws it, and only on a TTY unless ``force`` is set.
    """

    def __init__(self, force: bool = False, refresh_every: PositiveInt = 10) -> None:
        self.force = force
        self.refresh_every = refresh_every
        self._bar: Any = None

    def on_fit_start(self, state: Any) -> None:
        if state.rank != 0 or not (self.force or sys.stdout.isatty()):
            return
        from tqdm import tqdm

        try:
            total = state.to_batches(state.max_duration)
        except TimeError:
            total = None
        # Redrawn at most twice a second: each frame measures and writes a line, which at tqdm's default of ten a
        # second costs a short step more than the rest of the bar.
        self._bar = tqdm(total=total, initial=state.timestamp.batch, unit="ba", dynamic_ncols=True,
                         desc=state.run_name, leave=True, file=sys.stdout, mininterval=0.5)

    def on_batch_end(self, state: Any) -> None:
        if self._bar is None:
            return
        # The loss goes in before the count moves: update() is what draws, and it must draw this step's loss.
        if state.timestamp.batch % self.refresh_every == 0:
            self._show_loss(state, refresh=False)
        self._bar.update(1)

    def on_fit_end(self, state: Any) -> None:
        if self._bar is not None:
            self._show_loss(state, refresh=True)  # the last line shows the last step's loss, whatever the cadence

    def _show_loss(self, state: Any, refresh: bool) -> None:
        # The value the trainer read at its log interval when the cadences agree (as they do by default):
        # no extra wait for the device.
        value = state.batch_loss_value()
        if value is not None:
            self._bar.set_postfix(loss=f"{value:.4f}", refresh=refresh)

    def on_close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
