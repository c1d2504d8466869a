"""Stops training when an evaluation metric stops improving."""

from __future__ import annotations

import math
from typing import Any, Literal

from smalti.core.config.types import NonNegativeFloat, PositiveInt
from smalti.core.errors import ConfigError
from smalti.core.plugins import Callback


class EarlyStopping(Callback):
    """Stops after ``patience`` evaluation rounds in a row without an improvement of more than ``min_delta``.

    ``monitor`` names an evaluation metric as it is logged, ``"metrics/<eval label>/<metric>"``, or
    without the prefix (``"eval/CrossEntropy"``). ``mode="min"`` wants it lower, ``"max"`` higher. The
    first finite value sets the best. Metrics are computed over all ranks, so every rank stops together.
    """

    def __init__(self, monitor: str, mode: Literal["min", "max"] = "min", patience: PositiveInt = 3, min_delta: NonNegativeFloat = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"callbacks.early_stopping.mode={mode!r} must be 'min' or 'max'")
        if patience < 1:
            raise ConfigError(f"callbacks.early_stopping.patience={patience} must be at least 1 evaluation round")
        if min_delta < 0:
            raise ConfigError(f"callbacks.early_stopping.min_delta={min_delta} must be >= 0")
        label, _, metric = monitor.removeprefix("metrics/").partition("/")
        if not label or not metric:
            raise ConfigError(
                f"callbacks.early_stopping.monitor={monitor!r} must look like 'metrics/<eval label>/<metric>', "
                "e.g. 'metrics/eval/CrossEntropy'"
            )
        self.monitor = monitor
        self.label, self.metric = label, metric
        self.mode, self.patience, self.min_delta = mode, patience, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_rounds = 0

    def on_eval_after_all(self, state: Any) -> None:
        try:
            value = float(state.eval_metrics[self.label][self.metric])
        except KeyError:
            have = [f"metrics/{lab}/{m}" for lab, ms in state.eval_metrics.items() for m in ms]
            raise ConfigError(
                f"callbacks.early_stopping.monitor={self.monitor!r} is not among the evaluation metrics {have}"
            ) from None
        if self.mode == "min":
            better = value < self.best - self.min_delta
        else:
            better = value > self.best + self.min_delta
        if better:  # a NaN value never is, so it counts as a round without improvement
            self.best, self.bad_rounds = value, 0
        else:
            self.bad_rounds += 1

    def should_stop(self) -> bool | None:
        return True if self.bad_rounds >= self.patience else None

    def plugin_state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_rounds": self.bad_rounds}

    def load_plugin_state_dict(self, plugin_state: dict[str, Any]) -> None:
        self.best, self.bad_rounds = float(plugin_state["best"]), int(plugin_state["bad_rounds"])
