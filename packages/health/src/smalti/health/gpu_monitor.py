"""GPU monitor: the ``gpu`` check every ``interval_s`` seconds in a background thread, metrics to the loggers.

NVML is read off the training thread, so a slow or wedged driver never delays a step; the newest results
are logged at the next batch end. A ``fail`` verdict is logged as an error naming the GPU and, with
``cordon_file`` set, puts this host on the cordon list. On a machine without a GPU it says so once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from smalti.core import Callback
from smalti.core.config.types import PositiveFloat
from smalti.core.errors import ConfigError
from smalti.health.gpu import GpuChecker
from smalti.health.results import CheckResult, Verdict, merged_metrics

log = logging.getLogger(__name__)


class GpuMonitor(Callback):
    """Periodic NVML health of this node's GPUs, logged beside the loss."""

    def __init__(self, interval_s: PositiveFloat = 300.0, call_deadline_s: PositiveFloat = 5.0, cordon_file: str | None = None,
                 nvml: Any | None = None) -> None:
        if interval_s <= 0:
            raise ConfigError(f"health.gpu_monitor.interval_s={interval_s} must be positive")
        self.interval_s = interval_s
        self.cordon_file = cordon_file
        self._checker = GpuChecker(nvml, call_deadline_s)
        self._pending: list[CheckResult] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.checks_run = 0

    def on_fit_start(self, state: Any) -> None:
        """Start the checking thread (nothing on a machine without GPUs, after saying so once)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="smalti-gpu-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            results = self._checker.check()
            self.checks_run += 1
            with self._lock:
                self._pending = results
            if self._checker.no_gpu_reason is not None:
                log.info("gpu monitor: %s; not monitoring", self._checker.no_gpu_reason)
                return
            if self._stop.wait(self.interval_s):
                return

    def on_batch_end(self, state: Any, logger: Any) -> None:
        """Log the newest results, if a check finished since the last batch."""
        with self._lock:
            results, self._pending = self._pending, None
        if not results:
            return
        logger.log_metrics({k.replace("health/", f"health/rank{state.rank}/", 1) if state.world_size > 1 else k: v
                            for k, v in merged_metrics(results).items()})
        for result in results:
            if result.verdict is Verdict.FAIL:
                log.error("gpu monitor on rank %d: %s", state.rank, result.message)
                if self.cordon_file:
                    from smalti.health.cordon import add_to_cordon
                    from smalti.health.preflight import this_host

                    add_to_cordon(self.cordon_file, this_host(), f"gpu monitor: {result.message}")
            elif result.verdict is Verdict.WARN:
                log.warning("gpu monitor on rank %d: %s", state.rank, result.message)

    def on_close(self) -> None:
        """Stop the thread and release NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._checker.call_deadline_s + 1)
        self._checker.close()
