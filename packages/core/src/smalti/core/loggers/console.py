"""Prints metrics to the terminal on rank 0, one compact line per interval."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from smalti.core import distributed
from smalti.core.config.types import TimeOrBatches
from smalti.core.intervals import interval_fires
from smalti.core.plugins import LoggerDestination
from smalti.core.time import Time, TimeUnit


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

    def __init__(self, log_interval: TimeOrBatches = "10ba", rank_zero_only: bool = True, stream: TextIO | None = None,
                 keys: list[str] | None = None) -> None:
        """``keys``: metric-name prefixes to print (default: loss, lr, grad norm, throughput, MFU); ``["*"]`` for all."""
        self.interval = Time.from_input(log_interval, "ba")
        #: The trainer reads the step losses on the host at the finest ``log_interval`` of its plugins.
        self.log_interval = self.interval
        self.keys = tuple(keys) if keys is not None else self.DEFAULT_KEYS
        self.rank_zero_only = rank_zero_only
        self.stream = stream
        self._latest: dict[str, float] = {}
        # Per metric name: 0 not printed, 1 printed at the interval, 2 an eval metric printed at once.
        self._kind: dict[str, int] = {}
        # The keys of kinds 0 and 1: a metrics dict of only these is kept whole, and the printed ones picked at the
        # interval (the speed monitor logs every step; the console prints every tenth).
        self._interval_keys: set[str] = set()
        self._every = int(self.interval.value) if self.interval.unit is TimeUnit.BATCH else None
        self._active_in_fit: bool | None = None

    def _active(self) -> bool:
        if self._active_in_fit is not None:  # the rank does not change during fit: asked once
            return self._active_in_fit
        return not self.rank_zero_only or distributed.get_rank() == 0

    def on_fit_start(self) -> None:
        self._active_in_fit = None
        self._active_in_fit = self._active()

    def _classify(self, key: str) -> int:
        if key.startswith("metrics/"):
            kind = 2
        else:
            kind = 1 if self.keys == ("*",) or key.startswith(self.keys) else 0
            self._interval_keys.add(key)
        self._kind[key] = kind
        return kind

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=self.stream or sys.stdout)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        active = self._active_in_fit  # called every step by the speed monitor: the rank asked once per fit
        if not (active if active is not None else self._active()):
            return
        if metrics.keys() <= self._interval_keys:  # every key seen before, none an eval metric: one C-level update
            self._latest.update(metrics)
            return
        kinds, latest = self._kind, self._latest
        evals = None
        for key, value in metrics.items():
            kind = kinds.get(key)
            if kind is None:
                kind = self._classify(key)
            if kind == 2:
                evals = evals or {}
                evals[key] = value
            else:
                latest[key] = value
        if evals:
            self._write(f"[eval  {step}] " + "  ".join(f"{k.removeprefix('metrics/')}: {_fmt(v)}" for k, v in evals.items()))

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        if self._active():
            self._write(f"[config] {len(params)} sections: {', '.join(map(str, params))}")

    def on_batch_end(self, state: Any) -> None:
        if not self._latest:
            return
        if state.timestamp.batch % self._every == 0 if self._every else interval_fires(self.interval, state, "batch_end"):
            self._print(state)

    def on_fit_end(self, state: Any) -> None:
        if self._latest:
            self._print(state)
        self._active_in_fit = None

    def _print(self, state: Any) -> None:
        if not self._active():
            return
        kinds = self._kind
        printed = [(k, v) for k, v in self._latest.items() if kinds[k] == 1]
        self._latest.clear()
        if not printed:  # only metrics this logger does not print were logged since the last line
            return
        total = state.max_duration
        progress = f"{state.timestamp.get(total.unit)}/{total}" if total.unit.value != "dur" else ""
        body = "  ".join(f"{k}: {_fmt(v)}" for k, v in printed)
        self._write(f"[batch {state.timestamp.batch} {progress}] {body}")
