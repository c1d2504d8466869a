"""Logs device memory (CUDA allocator statistics) or, on CPU, the process's resident memory."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.intervals import interval_fires
from smalti.core.plugins import Callback
from smalti.core.time import Time


def process_memory_bytes() -> dict[str, float]:
    """Current and peak resident set size of this process, from ``/proc/self/status`` (Linux)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out["rss" if key == "VmRSS" else "peak_rss"] = float(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class MemoryMonitor(Callback):
    """Every ``interval``: ``memory/allocated_gb``, ``reserved_gb``, ``peak_allocated_gb`` on CUDA, ``memory/rss_gb`` on CPU."""

    def __init__(self, interval: str | int = "10ba") -> None:
        self.interval = Time.from_input(interval, "ba")

    def on_batch_end(self, state: Any, logger: Any) -> None:
        if not interval_fires(self.interval, state, "batch_end"):
            return
        gb = 1024**3
        if state.device.type == "cuda":
            stats = torch.cuda.memory_stats(state.device)
            metrics = {
                "memory/allocated_gb": stats.get("allocated_bytes.all.current", 0) / gb,
                "memory/reserved_gb": stats.get("reserved_bytes.all.current", 0) / gb,
                "memory/peak_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / gb,
                "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
            }
        else:
            metrics = {f"memory/{k}_gb": v / gb for k, v in process_memory_bytes().items()}
        logger.log_metrics(metrics)
