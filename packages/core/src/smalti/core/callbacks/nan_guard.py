"""Stops the run, or skips the optimizer step, when the loss is NaN or infinite."""

from __future__ import annotations

import math
from typing import Any

from smalti.core.errors import ConfigError, TrainingError
from smalti.core.plugins import Callback


class NaNGuard(Callback):
    """Checks the batch loss (already averaged over ranks, so every rank decides alike) before the optimizer step.

    ``action="stop"`` raises :class:`TrainingError` naming the batch; ``action="skip"`` skips the step (the
    weights stay as they were) and counts it in ``nan_guard/skipped_batches``; after ``max_skips`` skipped
    batches in a row it stops anyway.
    """

    def __init__(self, action: str = "stop", max_skips: int = 10) -> None:
        if action not in ("stop", "skip"):
            raise ConfigError(f"callbacks.nan_guard.action={action!r} must be 'stop' or 'skip'")
        self.action = action
        self.max_skips = max_skips
        self.skipped = 0
        self._in_a_row = 0

    def on_before_optimizer_step(self, state: Any, logger: Any) -> None:
        loss = float(state.batch_loss)
        if math.isfinite(loss):
            self._in_a_row = 0
            return
        where = f"batch {state.timestamp.batch + 1} (epoch {state.timestamp.epoch}, batch {state.timestamp.batch_in_epoch + 1} in epoch)"
        if self.action == "stop" or self._in_a_row >= self.max_skips:
            raise TrainingError(
                f"loss/train/total is {loss} at {where}; lower the learning rate, check the data, or set "
                "callbacks.nan_guard.action=skip to skip such batches"
            )
        state.skip_optimizer_step = True
        self.skipped += 1
        self._in_a_row += 1
        logger.log_metrics({"nan_guard/skipped_batches": self.skipped})

    def plugin_state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_plugin_state_dict(self, plugin_state: dict[str, Any]) -> None:
        self.skipped = plugin_state["skipped"]
