"""Prints metrics to the terminal on rank 0, one compact line per interval."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from smalti.core import distributed
from smalti.core.intervals import interval_fires
from smalti.core.plugins import LoggerDestination
from smalti.core.time import Time


def _fmt(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e6):
        return str(int(value))
    return f"{value:.4g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.4f}"


class ConsoleLogger(LoggerDestination):
    """Every ``log_interval`` prints the latest value of each metric logged since the last line; eval metrics at once.

    Writes through ``tqdm.write`` so lines do not break a progress bar.
    """

    DEFAULT_KEYS = ("loss/", "lr-", "grad_norm", "throughput/samples_per_sec", "throughput/tokens_per_sec",
                    "throughput/mfu", "nan_guard/", "memory/peak")

    def __init__(self, log_interval: str | int = "10ba", rank_zero_only: bool = True, stream: TextIO | None = None,
                 keys: list[str] | None = None) -> None:
        """``keys``: metric-name prefixes to print (default: loss, lr, grad norm, throughput, MFU); ``["*"]`` for all."""
        self.interval = Time.from_input(log_interval, "ba")
        #: The trainer reads the step losses on the host at the finest ``log_interval`` of its plugins.
        self.log_interval = self.interval
        self.keys = tuple(keys) if keys is not None else self.DEFAULT_KEYS
        self.rank_zero_only = rank_zero_only
        self.stream = stream
        self._latest: dict[str, float] = {}

    def _active(self) -> bool:
        return not self.rank_zero_only or distributed.get_rank() == 0

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=self.stream or sys.stdout)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._active():
            return
        evals = {k: v for k, v in metrics.items() if k.startswith("metrics/")}
        if evals:
            self._write(f"[eval  {step}] " + "  ".join(f"{k.removeprefix('metrics/')}: {_fmt(v)}" for k, v in evals.items()))
        for key, value in metrics.items():
            if key not in evals and (self.keys == ("*",) or key.startswith(self.keys)):
                self._latest[key] = value

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        if self._active():
            self._write(f"[config] {len(params)} sections: {', '.join(map(str, params))}")

    def on_batch_end(self, state: Any) -> None:
        if self._latest and interval_fires(self.interval, state, "batch_end"):
            self._print(state)

    def on_fit_end(self, state: Any) -> None:
        if self._latest:
            self._print(state)

    def _print(self, state: Any) -> None:
        if not self._active():
            return
        total = state.max_duration
        progress = f"{state.timestamp.get(total.unit)}/{total}" if total.unit.value != "dur" else ""
        body = "  ".join(f"{k}: {_fmt(v)}" for k, v in self._latest.items())
        self._write(f"[batch {state.timestamp.batch} {progress}] {body}")
        self._latest.clear()
