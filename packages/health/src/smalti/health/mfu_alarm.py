"""Throughput/MFU alarm: when the run stays below a floor, find out why and (optionally) stop it.

Every ``interval`` batches it measures samples/s (and MFU when the model has ``flops_per_batch`` and the
device's peak is known, as the core's speed monitor does). The ranks agree on each interval's verdict: a MAX
all-reduce of the low flag on the default group makes an interval low everywhere when it is low on any rank.
Below ``min_samples_per_sec`` or ``min_mfu`` for ``patience`` intervals in a row it runs the quick compute
and collective checks on every rank, logs their metrics and a report, and with ``action: stop`` raises on
every rank so the run ends non-zero and torchrun's agent restarts it (with ``cordon_file`` set, a rank whose
compute check failed cordons its host first).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch

from smalti.core import Callback, distributed
from smalti.core.config.types import PositiveFloat, PositiveInt, Probability
from smalti.core.errors import ConfigError, TrainingError
from smalti.health.results import CheckResult, Verdict, merged_metrics

log = logging.getLogger(__name__)


class ThroughputAlarm(Callback):
    """Raises the alarm on sustained low throughput or MFU; runs the health checks to say why."""

    def __init__(self, min_samples_per_sec: PositiveFloat | None = None, min_mfu: Probability | None = None, interval: PositiveInt = 50,
                 patience: PositiveInt = 3, action: Literal["warn", "stop"] = "warn", run_checks: bool = True, check_seconds: PositiveFloat = 0.5,
                 collective_bytes: PositiveInt = 1 << 20, cordon_file: str | None = None,
                 peak_flops: PositiveFloat | None = None) -> None:
        if min_samples_per_sec is None and min_mfu is None:
            raise ConfigError("health.mfu_alarm: set min_samples_per_sec or min_mfu (or both)")
        if action not in ("warn", "stop"):
            raise ConfigError(f"health.mfu_alarm.action={action!r}: choose warn or stop")
        if interval < 1 or patience < 1:
            raise ConfigError(f"health.mfu_alarm: interval={interval} and patience={patience} must be >= 1")
        self.min_samples_per_sec = min_samples_per_sec
        self.min_mfu = min_mfu
        self.interval = interval
        self.patience = patience
        self.action = action
        self.run_checks = run_checks
        self.check_seconds = check_seconds
        self.collective_bytes = collective_bytes
        self.cordon_file = cordon_file
        self.peak_flops = peak_flops
        self._low = 0
        self._t0: float | None = None
        self._samples = 0
        self._flops = 0.0
        self._batches = 0
        self._flops_fn: Any = None
        self.alarms: list[list[CheckResult]] = []

    def on_fit_start(self, state: Any) -> None:
        counter = getattr(state.raw_model, "flops_per_batch", None)
        self._flops_fn = counter if callable(counter) else None
        if self.peak_flops is None and state.device.type == "cuda":
            from smalti.core.callbacks.speed_monitor import matmul_precision, peak_flops

            self.peak_flops = peak_flops(torch.cuda.get_device_name(state.device), matmul_precision(state.precision))
        if self.min_mfu is not None and not (self._flops_fn and self.peak_flops):
            log.warning("health.mfu_alarm: min_mfu is set but the model has no flops_per_batch or the device's peak "
                        "is unknown (set peak_flops); only min_samples_per_sec is watched")
        self._t0 = time.perf_counter()

    def on_batch_end(self, state: Any, logger: Any) -> None:
        """Count the batch; at each interval compare with the floors and act after ``patience`` lows."""
        self._batches += 1
        self._samples += state.batch_num_samples
        if self._flops_fn is not None:
            self._flops += float(self._flops_fn(state.batch))
        if self._batches % self.interval:
            return
        now = time.perf_counter()
        seconds, self._t0 = now - (self._t0 or now), now
        rate = self._samples / seconds if seconds > 0 else float("inf")
        mfu = self._flops / seconds / self.peak_flops if self._flops and self.peak_flops and seconds > 0 else None
        self._samples, self._flops = 0, 0.0
        low = []
        if self.min_samples_per_sec is not None and rate < self.min_samples_per_sec:
            low.append(f"{rate:.2f} samples/s < {self.min_samples_per_sec:g}")
        if self.min_mfu is not None and mfu is not None and mfu < self.min_mfu:
            low.append(f"MFU {mfu:.3f} < {self.min_mfu:g}")
        metrics = {"health/mfu_alarm/samples_per_sec": rate, "health/mfu_alarm/low_intervals": 0.0}
        if mfu is not None:
            metrics["health/mfu_alarm/mfu"] = mfu
        # Ranks measure alone and can disagree; the checks below run collectives and action=stop must end every
        # rank, so the interval counts as low when it is low on any rank (one small all-reduce per interval).
        any_low = bool(distributed.all_reduce_max(int(bool(low)), state.device))
        if any_low and not low:
            low.append("below the floor on another rank")
        self._low = self._low + 1 if any_low else 0
        metrics["health/mfu_alarm/low_intervals"] = float(self._low)
        if self._low < self.patience:
            logger.log_metrics(metrics)
            return
        self._low = 0
        results = self._diagnose(state)
        self.alarms.append(results)
        metrics["health/mfu_alarm/alarms"] = float(len(self.alarms))
        logger.log_metrics({**metrics, **merged_metrics(results)})
        summary = (f"throughput alarm at batch {state.timestamp.batch}: {'; '.join(low)} for {self.patience} "
                   f"intervals of {self.interval} batches; checks: "
                   + ("; ".join(f"{r.name} {r.verdict.value}: {r.message}" for r in results) or "not run"))
        log.error(summary)
        if self.action == "stop":
            raise TrainingError(summary + " (health.mfu_alarm.action=stop: ending the run so it can be restarted)")
        # the interval's clock restarts after the checks, which must not count against throughput
        self._t0 = time.perf_counter()

    def _diagnose(self, state: Any) -> list[CheckResult]:
        if not self.run_checks:
            return []
        from smalti.health.collectives import run_collectives
        from smalti.health.compute import run_compute_check

        results = [run_compute_check(state.device, size=1024, seconds=self.check_seconds)]
        results += run_collectives(("all_reduce",), (self.collective_bytes,), iters=3)
        failed = [r for r in results if r.verdict is Verdict.FAIL and r.name.startswith("compute")]
        if failed and self.cordon_file:
            from smalti.health.cordon import add_to_cordon
            from smalti.health.preflight import this_host

            add_to_cordon(self.cordon_file, this_host(), f"throughput alarm: {failed[0].message}")
        return results
