"""Remaining wall time from the measured step rate, with evaluation and checkpoint time counted apart."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

from smalti.core.config.types import NonNegativeInt, PositiveInt, TimeOrBatches
from smalti.core.errors import ConfigError, TimeError
from smalti.core.intervals import batch_count
from smalti.core.plugins import Callback
from smalti.core.time import TimeUnit


def format_seconds(seconds: float) -> str:
    """``1:02:03`` for 3723 s; ``?`` when not known."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class RuntimeEstimator(Callback):
    """Logs ``wall_clock/remaining_estimate`` (seconds until ``max_duration``) every ``interval`` batches.

    The time of one batch is measured from one request to the data loader to the next, less the time spent
    evaluating (between ``on_eval_before_all`` and ``on_eval_after_all``) and, on a batch that
    checkpointed, less what the checkpoint added over a typical batch. The estimate is

        remaining batches x median batch time over the last ``window_size`` batches
        + evaluation rounds still due x mean round time
        + remaining batches x checkpoint seconds per batch so far

    Evaluation rounds still due are counted from ``eval_interval`` when it is in batches, else from the
    rate so far. The first ``skip_batches`` of each process (compilation, warm-up) are left out of the
    rate. Also logged: ``wall_clock/train``, ``wall_clock/eval`` and ``wall_clock/checkpoint``, the seconds
    this process spent on each. The estimate is shown on the progress bar (``eta``) when one is drawn.
    """

    def __init__(self, interval: TimeOrBatches = "10ba", window_size: PositiveInt = 50, skip_batches: NonNegativeInt = 1) -> None:
        every = batch_count(interval, "callbacks.runtime_estimator.interval")
        if window_size < 1:
            raise ConfigError(f"callbacks.runtime_estimator.window_size={window_size} must be >= 1")
        self._every = every
        self.window_size = window_size
        self.skip_batches = max(0, int(skip_batches))
        self._window: deque[float] = deque(maxlen=window_size)
        self.train_s = self.eval_s = self.checkpoint_s = 0.0
        self.eval_rounds = 0
        self._seen = 0
        self._cycle_t0: float | None = None
        self._eval_t0 = 0.0
        self._eval_in_cycle = 0.0
        self._checkpointed = False
        self.estimate: float | None = None

    # ------------------------------------------------------------------ measuring

    def on_fit_start(self) -> None:
        self._cycle_t0 = None

    def on_before_dataloader(self, state: Any, logger: Any) -> None:
        now = time.perf_counter()
        if self._cycle_t0 is not None:
            self._close_cycle(now - self._cycle_t0, state, logger)
        self._cycle_t0 = now
        self._eval_in_cycle = 0.0
        self._checkpointed = False

    def on_fit_end(self, state: Any, logger: Any) -> None:
        if self._cycle_t0 is not None:
            self._close_cycle(time.perf_counter() - self._cycle_t0, state, logger)
            self._cycle_t0 = None

    def _close_cycle(self, cycle: float, state: Any, logger: Any) -> None:
        work = max(0.0, cycle - self._eval_in_cycle)
        if self._checkpointed and self._window:
            typical = statistics.median(self._window)
            self.checkpoint_s += max(0.0, work - typical)
            work = min(work, typical)
        self.train_s += work
        self._seen += 1
        if self._seen > self.skip_batches:
            self._window.append(work)
        if state.timestamp.batch % self._every == 0 or state.reached(state.max_duration):
            self._report(state, logger)

    def on_eval_before_all(self) -> None:
        self._eval_t0 = time.perf_counter()

    def on_eval_after_all(self) -> None:
        spent = time.perf_counter() - self._eval_t0
        self.eval_s += spent
        self._eval_in_cycle += spent
        self.eval_rounds += 1

    def on_batch_checkpoint(self, state: Any) -> None:
        self._checkpointed = self._checkpointed or bool(state.checkpoint_requested)

    # ------------------------------------------------------------------ estimating

    def remaining_seconds(self, state: Any) -> float | None:
        """The estimate now, or ``None`` before a batch was timed (or when the duration cannot be counted)."""
        if not self._window:
            return None
        try:
            total = state.to_batches(state.max_duration)
        except TimeError:
            return None
        done = state.timestamp.batch
        left = max(0, total - done)
        seconds = left * statistics.median(self._window)
        if self.eval_rounds:
            per_round = self.eval_s / self.eval_rounds
            interval = state.eval_interval
            if interval is not None and interval.unit is TimeUnit.BATCH and interval.value > 0:
                every = int(interval.value)
                rounds = total // every - done // every + (1 if total % every else 0)
            else:
                rounds = self.eval_rounds / max(1, self._seen) * left
            seconds += rounds * per_round
        if self.checkpoint_s:
            seconds += self.checkpoint_s / max(1, self._seen) * left
        return seconds

    def _report(self, state: Any, logger: Any) -> None:
        self.estimate = self.remaining_seconds(state)
        metrics = {"wall_clock/train": self.train_s, "wall_clock/eval": self.eval_s,
                   "wall_clock/checkpoint": self.checkpoint_s}
        if self.estimate is not None:
            metrics["wall_clock/remaining_estimate"] = self.estimate
            self._show(state, self.estimate)
        logger.log_metrics(metrics, step=state.timestamp.batch)

    @staticmethod
    def _show(state: Any, seconds: float) -> None:
        """Put ``eta`` in the progress bar's description (its postfix belongs to the bar's own loss)."""
        from smalti.core.callbacks.progress_bar import ProgressBar

        manager = state.plugin_manager
        for plugin in manager.get_plugins() if manager is not None else ():
            bar = getattr(plugin, "_bar", None) if isinstance(plugin, ProgressBar) else None
            if bar is not None:
                bar.set_description(f"{state.run_name} eta {format_seconds(seconds)}", refresh=False)
