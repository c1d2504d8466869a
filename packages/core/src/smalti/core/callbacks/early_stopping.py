"""Stops training when an evaluation metric stops improving."""

from __future__ import annotations

import math
from typing import Any

from smalti.core.errors import ConfigError
from smalti.core.plugins import Callback


class EarlyStopping(Callback):
    """Stops after ``patience`` evaluation rounds without an improvement of at least ``min_delta`` in ``monitor``.

    ``monitor`` is ``"<eval label>/<metric>"`` (``"eval/CrossEntropy"``; a ``metrics/`` prefix is accepted).
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"callbacks.early_stopping.mode={mode!r} must be 'min' or 'max'")
        label, _, metric = monitor.removeprefix("metrics/").partition("/")
        if not metric:
            raise ConfigError(f"callbacks.early_stopping.monitor={monitor!r} must look like '<eval label>/<metric>'")
        self.label, self.metric = label, metric
        self.mode, self.patience, self.min_delta = mode, patience, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_rounds = 0

    def on_eval_after_all(self, state: Any) -> None:
        try:
            value = state.eval_metrics[self.label][self.metric]
        except KeyError:
            raise ConfigError(
                f"early stopping monitors {self.label}/{self.metric}, but evaluation produced "
                f"{[f'{lab}/{m}' for lab, ms in state.eval_metrics.items() for m in ms]}"
            ) from None
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best, self.bad_rounds = value, 0
        else:
            self.bad_rounds += 1

    def should_stop(self, state: Any) -> bool | None:
        return True if self.bad_rounds >= self.patience else None

    def plugin_state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_rounds": self.bad_rounds}

    def load_plugin_state_dict(self, plugin_state: dict[str, Any]) -> None:
        self.best, self.bad_rounds = plugin_state["best"], plugin_state["bad_rounds"]
