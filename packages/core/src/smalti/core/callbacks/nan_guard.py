"""Stops the run, or skips the optimizer step, when the loss is NaN or infinite."""

from __future__ import annotations

import math
from typing import Any, Literal

from smalti.core.config.types import NonNegativeInt
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.plugins import Callback


class NaNGuard(Callback):
    """Stops the run, or skips the optimizer step, on a NaN or infinite ``loss/train/total``.

    The trainer averages ``state.batch_loss`` over ranks, so a NaN or infinity on any rank reaches every
    rank and all of them take the same decision.

    ``action="stop"`` raises :class:`TrainingError` naming the batch and the value. It reads the losses the
    trainer hands the loggers, so it adds no wait for the device: the trainer reads them once per log interval,
    before every checkpoint and at the end, so the run stops at most one log interval after the bad batch and
    never saves a checkpoint after it.

    ``action="skip"`` must know before each optimizer step, so it reads each step's loss (one host sync per
    step on a GPU). It sets ``state.skip_optimizer_step`` (the weights and the optimizer state stay as they
    were), counts the batch in ``nan_guard/skipped_batches``, and still stops after ``max_skips`` skipped
    batches in a row.
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_skips: NonNegativeInt = 10) -> None:
        if action not in ("stop", "skip"):
            raise ConfigError(f"callbacks.nan_guard.action={action!r} must be 'stop' or 'skip'")
        if max_skips < 0:
            raise ConfigError(f"callbacks.nan_guard.max_skips={max_skips} must be >= 0")
        self.action = action
        self.max_skips = max_skips
        self.skipped = 0
        self._in_a_row = 0
        self._epoch_start = (0, 0)  # (epoch, first batch of it), to name a batch logged after the fact

    @property
    def optimizer_in_backward_conflict(self) -> str | None:
        """Why ``trainer.optimizer_in_backward=true`` refuses ``action="skip"`` (``"stop"`` works with it)."""
        if self.action != "skip":
            return None
        return "action='skip' skips optimizer steps, which the step in backward has already taken; use action='stop'"

    def on_epoch_start(self, state: Any) -> None:
        self._epoch_start = (state.timestamp.epoch, state.timestamp.batch)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.action != "stop" or "loss/train/total" not in metrics:
            return
        loss = float(metrics["loss/train/total"])
        if not math.isfinite(loss):
            epoch, first = self._epoch_start
            where = f"batch {step} (epoch {epoch}, batch {step - first} of the epoch)"
            raise TrainingError(
                f"loss/train/total is {loss} at {where}; lower the learning rate, add gradient clipping, check "
                "the data, or set callbacks.nan_guard.action=skip to skip such batches"
            )

    def on_before_optimizer_step(self, state: Any, logger: Any) -> None:
        if self.action != "skip":
            return
        loss = state.batch_loss_value() if state.batch_loss is not None else float(state.loss)
        if math.isfinite(loss):
            self._in_a_row = 0
            return
        ts = state.timestamp
        where = f"batch {ts.batch + 1} (epoch {ts.epoch}, batch {ts.batch_in_epoch + 1} of the epoch)"
        if self._in_a_row >= self.max_skips:
            raise TrainingError(
                f"loss/train/total is {loss} at {where}, after {self._in_a_row} skipped batches in a row "
                f"(callbacks.nan_guard.max_skips={self.max_skips}); the run is diverging: lower the learning rate "
                "or resume from an earlier checkpoint"
            )
        state.skip_optimizer_step = True
        self.skipped += 1
        self._in_a_row += 1
        logger.log_metrics({"nan_guard/skipped_batches": self.skipped})

    def plugin_state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_plugin_state_dict(self, plugin_state: dict[str, Any]) -> None:
        self.skipped = int(plugin_state["skipped"])
