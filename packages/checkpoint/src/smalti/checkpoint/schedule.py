"""When to save: the save cadence, preemption signals, step timing and the metrics the saves record."""

from __future__ import annotations

import logging
import signal
import statistics
import threading
import time
from typing import Any

import torch

from smalti.core import distributed
from smalti.core.intervals import interval_fires

log = logging.getLogger(__name__)


class SaveSchedule:
    """Decides when the :class:`~smalti.checkpoint.Checkpointer` saves (interval, fit end, a preemption signal
    agreed by every rank) and when the run stops after a signal-triggered save.

    Part of :class:`~smalti.checkpoint.Checkpointer`, whose ``__init__`` sets the attributes used here.
    """

    def on_init(self, state: Any, logger: Any) -> None:
        if self.signals and threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal_flag = signum
        log.warning("received %s: saving a checkpoint after this batch, then stopping", signal.Signals(signum).name)


    def on_batch_start(self, state: Any, logger: Any) -> None:
        self._step_start = time.perf_counter()
        self._step_in_flight = self._thread is not None and self._thread.is_alive()

    def on_batch_end(self, state: Any, logger: Any) -> None:
        # A step is timed from its start to its end, so a save's own blocked time (at the checkpoint event,
        # after batch end) never counts; a step that began while a save was in flight is an in-flight step.
        metrics: dict[str, float] = {}
        if self._step_start is not None:
            step = time.perf_counter() - self._step_start
            if self._step_in_flight:
                metrics["checkpoint/step_time_in_flight_s"] = step
                if self._normal_steps:
                    normal = statistics.median(self._normal_steps)
                    metrics["checkpoint/step_time_s"] = normal
                    metrics["checkpoint/step_time_in_flight_ratio"] = step / normal
            else:
                self._normal_steps.append(step)
            self._step_start = None
        if metrics:
            logger.log_metrics(metrics)
        self._flush_metrics(logger)
        if self.signals:
            self._signal_save = self._any_rank_signalled()

    def _any_rank_signalled(self) -> bool:
        """Whether a save-on-signal arrived on any rank: a MAX over a CPU tensor on a gloo group, so the
        check costs no device synchronisation (an all_reduce on the training device would sync the GPU)."""
        if self._signal_group is None:
            return bool(self._signal_flag)
        return bool(distributed.all_reduce_max(int(self._signal_flag), torch.device("cpu"), self._signal_group))

    def should_checkpoint(self, state: Any, event: Any) -> bool | None:
        event = str(event)
        if event == "batch_end":
            if self._signal_save:
                return True
            if self.save_interval is not None and interval_fires(self.save_interval, state, "batch_end"):
                return True
        elif event == "epoch_end":
            if self.save_interval is not None and interval_fires(self.save_interval, state, "epoch_end"):
                return True
        elif event == "fit_end" and self.save_on_fit_end:
            return True
        return None

    def should_stop(self, state: Any) -> bool | None:
        return True if self._stop_after_save else None

    def on_batch_checkpoint(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:
            self.save(state, logger)
            if self._signal_save:
                self._stop_after_save = True

    def on_epoch_checkpoint(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:
            self.save(state, logger)

    def on_fit_end(self, state: Any, logger: Any) -> None:
        if state.checkpoint_requested:
            self.save(state, logger)
        self.wait()
        self._flush_metrics(logger)

    def on_exception(self, state: Any, logger: Any, exc: BaseException) -> None:
        self._failed = True

    def on_close(self, state: Any, logger: Any) -> None:
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks.clear()
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()
        if not self._failed:
            self.wait()

    def _flush_metrics(self, logger: Any) -> None:
        """Log what the background threads recorded, one call per record (two saves that finished within one
        batch each keep their ``checkpoint/save_s``)."""
        with self._lock:
            pending, self._metrics = self._metrics, []
        for item in pending:
            logger.log_metrics(item)
