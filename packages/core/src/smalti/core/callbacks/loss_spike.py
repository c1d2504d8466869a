"""Loss spikes and high-loss plateaus against a running window, with an action: log, save and stop, or roll back."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Annotated, Any, Literal

import torch

from smalti.core.config.types import Field, NonNegativeInt, PositiveFloat, PositiveInt, TimeOrBatches
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.intervals import batch_count
from smalti.core.plugins import Callback

log = logging.getLogger(__name__)

ACTIONS = ("log", "save_and_stop", "rollback")


def _to_host(value: Any) -> Any:
    """A copy of a (nested) state dict with every tensor on the CPU, so a rollback has its own snapshot."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_host(v) for v in value)
    return value


class LossSpike(Callback):
    """Watches ``loss/train/total`` after every batch against the mean of the last ``window_size`` losses.

    * a **spike**: the loss is above ``outlier_multiplier`` times the window's mean for more than
      ``patience`` batches in a row (LLM Foundry's kill-loss-spike rule);
    * a **plateau**: the window is full and every loss in it is above ``loss_cap``.

    Outlier batches do not enter the window, so a spike does not raise its own bar. Detection starts once
    ``window_size`` losses were seen. The losses are read from the device every ``check_interval`` batches
    (one transfer for all of them; ``1ba`` acts at once, a longer interval never makes a step wait for the
    device but acts up to that many batches late). On a detection it logs ``loss_spike/detected`` (1 spike,
    2 plateau) at the offending batch's step, with a warning naming the batch and the losses, then, by
    ``action``:

    * ``log``: nothing more;
    * ``save_and_stop``: asks for a checkpoint at this batch (``should_checkpoint``) and stops the run;
    * ``rollback``: before the next batch, restores the weights, optimizer, schedulers, RNG and time saved
      by the last checkpoint (or where the run started or resumed), and goes on with the data *after* the
      batches that caused it: the batches since that checkpoint are skipped. Logs
      ``loss_spike/rollbacks`` and ``loss_spike/skipped_batches``. Gives up with :class:`TrainingError`
      after ``max_rollbacks``. Cost: a host-memory copy of the model and optimizer state, refreshed at
      every checkpoint (the copy is what is rolled back to).

    The loss the trainer logs is already the mean over ranks, so every rank decides the same.
    """

    def __init__(self, action: Literal["log", "save_and_stop", "rollback"] = "log", window_size: PositiveInt = 100, outlier_multiplier: Annotated[float, Field(gt=1)] = 2.0,
                 patience: NonNegativeInt = 4, loss_cap: PositiveFloat | None = 10.0, max_rollbacks: NonNegativeInt = 3,
                 check_interval: TimeOrBatches = "1ba") -> None:
        if action not in ACTIONS:
            raise ConfigError(f"callbacks.loss_spike.action={action!r} must be one of {', '.join(ACTIONS)}")
        if window_size < 1:
            raise ConfigError(f"callbacks.loss_spike.window_size={window_size} must be at least 1 batch")
        if not outlier_multiplier > 1:
            raise ConfigError(f"callbacks.loss_spike.outlier_multiplier={outlier_multiplier} must be > 1")
        if patience < 0:
            raise ConfigError(f"callbacks.loss_spike.patience={patience} must be >= 0")
        self._every = batch_count(check_interval, "callbacks.loss_spike.check_interval", "1ba")
        self._pending: list[tuple[int, torch.Tensor]] = []
        self.action = action
        self.window_size = window_size
        self.outlier_multiplier = float(outlier_multiplier)
        self.patience = patience
        self.loss_cap = loss_cap
        self.max_rollbacks = max_rollbacks
        self.window: deque[float] = deque(maxlen=window_size)
        self.outliers: list[int] = []
        self.rollbacks = 0
        self.skipped_batches = 0
        self._detected = 0
        self._snapshot: dict[str, Any] | None = None
        self._rollback_pending = False

    # ------------------------------------------------------------------ detection

    def on_batch_end(self, state: Any, logger: Any) -> None:
        if state.batch_loss is None:
            return
        batch = state.timestamp.batch
        self._pending.append((batch, state.batch_loss))
        if batch % self._every and not state.reached(state.max_duration):
            return
        pending, self._pending = self._pending, []
        # One transfer per check: the steps in between never wait for the device.
        values = torch.stack([loss.reshape(()).float() for _, loss in pending]).tolist()
        for (step, _), loss in zip(pending, values):
            kind = self._observe(loss, step)
            if kind:
                self._act(kind, loss, step, logger)

    def _act(self, kind: int, loss: float, batch: int, logger: Any) -> None:
        mean = sum(self.window) / len(self.window)
        what = "loss spike" if kind == 1 else "high-loss plateau"
        log.warning(
            "%s at batch %d: loss %.4g against a window mean of %.4g (outlier batches %s, loss_cap %s); action: %s",
            what, batch, loss, mean, self.outliers or "-", self.loss_cap, self.action,
        )
        logger.log_metrics({"loss_spike/detected": float(kind)}, step=batch)
        self._detected = kind
        if self.action == "rollback":
            if self.rollbacks >= self.max_rollbacks:
                raise TrainingError(
                    f"{what} at batch {batch} after {self.rollbacks} rollbacks "
                    f"(callbacks.loss_spike.max_rollbacks={self.max_rollbacks}); lower the learning rate or "
                    "resume from an earlier checkpoint with other data"
                )
            self._rollback_pending = True

    def _observe(self, loss: float, batch: int) -> int:
        """0 for a normal batch, 1 for a spike, 2 for a plateau; keeps the window up to date."""
        full = len(self.window) == self.window_size
        if full:
            mean = sum(self.window) / len(self.window)
            if not math.isfinite(loss) or loss > self.outlier_multiplier * mean:
                self.outliers.append(batch)
                return 1 if len(self.outliers) > self.patience else 0
        self.outliers = []
        self.window.append(loss)
        full = len(self.window) == self.window_size
        if full and self.loss_cap is not None and min(self.window) > self.loss_cap:
            return 2
        return 0

    # ------------------------------------------------------------------ actions

    def should_checkpoint(self, state: Any) -> bool | None:
        if self._detected and self.action == "save_and_stop":
            return True
        if self._rollback_pending:
            return False  # the state after a spike is not worth keeping
        return None

    def should_stop(self) -> bool | None:
        if self._detected and self.action == "save_and_stop":
            return True
        self._detected = 0
        return None

    def on_fit_start(self, state: Any) -> None:
        if self.action == "rollback":
            self._snapshot = _to_host(state.state_dict())  # where the run started or resumed

    def on_batch_checkpoint(self, state: Any) -> None:
        if self.action == "rollback" and state.checkpoint_requested and not self._rollback_pending:
            self._snapshot = _to_host(state.state_dict())

    def on_epoch_checkpoint(self, state: Any) -> None:
        self.on_batch_checkpoint(state)

    def on_batch_start(self, state: Any, logger: Any) -> None:
        if not self._rollback_pending:
            return
        snapshot = self._snapshot
        assert snapshot is not None  # taken at fit start
        skipped = state.timestamp.batch - snapshot["timestamp"]["batch"]
        state.raw_model.load_state_dict(snapshot["model"])
        # Every plugin's state goes back too (ours keeps its counters); the data loader goes on from here.
        state.load_training_state_dict({**snapshot, "dataloader": None})
        self._rollback_pending = False
        self.rollbacks += 1
        self.skipped_batches += skipped
        self.outliers = []
        log.warning("rolled back to batch %d; the %d batches since are skipped (rollback %d of at most %d)",
                    state.timestamp.batch, skipped, self.rollbacks, self.max_rollbacks)
        logger.log_metrics({"loss_spike/rollbacks": float(self.rollbacks),
                            "loss_spike/skipped_batches": float(self.skipped_batches)})

    # ------------------------------------------------------------------ resumable state

    def plugin_state_dict(self) -> dict[str, Any]:
        return {"window": list(self.window), "rollbacks": self.rollbacks, "skipped_batches": self.skipped_batches}

    def load_plugin_state_dict(self, plugin_state: dict[str, Any]) -> None:
        if self._rollback_pending:  # our own rollback: keep the counters, forget the spike's window
            self.window = deque(plugin_state["window"], maxlen=self.window_size)
            return
        self.window = deque(plugin_state["window"], maxlen=self.window_size)
        self.rollbacks = int(plugin_state["rollbacks"])
        self.skipped_batches = int(plugin_state["skipped_batches"])
