"""Logs device memory (CUDA allocator statistics) or, on CPU, the process's resident memory."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from smalti.core.config.types import TimeOrBatches
from smalti.core.intervals import interval_fires
from smalti.core.plugins import Callback
from smalti.core.time import Time

_GB = 1024**3


def process_memory_bytes() -> dict[str, float]:
    """This process's resident set size now (``rss``) and at its peak (``peak_rss``), in bytes.

    Reads ``/proc/self/status`` on Linux; elsewhere only the peak is known (from ``getrusage``).
    """
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out["rss" if key == "VmRSS" else "peak_rss"] = float(value.split()[0]) * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss"] = float(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB elsewhere
    return out


def cuda_memory_bytes(device: torch.device) -> tuple[dict[str, float], float]:
    """The CUDA caching allocator's current, reserved and peak bytes on ``device``, and its retry count."""
    stats = torch.cuda.memory_stats(device)
    return {
        "allocated": float(stats.get("allocated_bytes.all.current", 0)),
        "reserved": float(stats.get("reserved_bytes.all.current", 0)),
        "peak_allocated": float(stats.get("allocated_bytes.all.peak", 0)),
        "peak_reserved": float(stats.get("reserved_bytes.all.peak", 0)),
    }, float(stats.get("num_alloc_retries", 0))


class MemoryMonitor(Callback):
    """Every ``interval`` (a time such as ``"10ba"``, or an int of batches) logs this rank's memory in GiB.

    On CUDA: ``memory/allocated_gb``, ``memory/reserved_gb``, ``memory/peak_allocated_gb``,
    ``memory/peak_reserved_gb`` and ``memory/alloc_retries`` (retries mean the allocator is close to out of
    memory). On CPU: ``memory/rss_gb`` and ``memory/peak_rss_gb`` of the process.
    """

    def __init__(self, interval: TimeOrBatches = "10ba") -> None:
        self.interval = Time.from_input(interval, "ba")

    def on_batch_end(self, state: Any, logger: Any) -> None:
        if interval_fires(self.interval, state, "batch_end"):
            self._log(state, logger)

    def on_epoch_end(self, state: Any, logger: Any) -> None:
        if interval_fires(self.interval, state, "epoch_end"):
            self._log(state, logger)

    def _log(self, state: Any, logger: Any) -> None:
        if state.device.type == "cuda":
            sizes, retries = cuda_memory_bytes(state.device)
            metrics = {f"memory/{k}_gb": v / _GB for k, v in sizes.items()}
            metrics["memory/alloc_retries"] = retries
        else:
            metrics = {f"memory/{k}_gb": v / _GB for k, v in process_memory_bytes().items()}
        logger.log_metrics(metrics)
