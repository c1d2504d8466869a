"""Throughput and model FLOPs utilisation (MFU) over a sliding window of steps."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from smalti.core.plugins import Callback

# Dense (not sparse) peak FLOP/s per device from NVIDIA's datasheets, by smalti precision name.
# amp_* run the matmuls in 16 bits; fp32 means plain fp32 (set tf32 yourself and pass gpu_flops_available).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h200": {"fp32": 67e12, "tf32": 494.7e12, "amp_bf16": 989.4e12, "amp_fp16": 989.4e12, "amp_fp8": 1978.9e12},
    "h100-sxm": {"fp32": 67e12, "tf32": 494.7e12, "amp_bf16": 989.4e12, "amp_fp16": 989.4e12, "amp_fp8": 1978.9e12},
    "h100-nvl": {"fp32": 60e12, "tf32": 417.5e12, "amp_bf16": 835.5e12, "amp_fp16": 835.5e12, "amp_fp8": 1671e12},
    "h100-pcie": {"fp32": 51e12, "tf32": 378e12, "amp_bf16": 756e12, "amp_fp16": 756e12, "amp_fp8": 1513e12},
    "a100": {"fp32": 19.5e12, "tf32": 156e12, "amp_bf16": 312e12, "amp_fp16": 312e12},
}


def device_key(name: str) -> str | None:
    """Map a CUDA device name (``NVIDIA H100 80GB HBM3``) to a row of :data:`PEAK_FLOPS`."""
    name = name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        if "nvl" in name:
            return "h100-nvl"
        if "pcie" in name:
            return "h100-pcie"
        return "h100-sxm"
    if "a100" in name:
        return "a100"
    return None


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one device of ``device_name`` at ``precision``, or ``None`` when unknown."""
    key = device_key(device_name)
    return PEAK_FLOPS.get(key, {}).get(precision) if key else None


class SpeedMonitor(Callback):
    """Logs ``throughput/*`` (batches, samples and tokens per second, global and per device) and ``throughput/mfu``.

    Rates are over the last ``window_size`` steps, each timed from one batch end to the next (data loading
    included). MFU divides the model's ``flops_per_batch`` per second by the device's peak; on CPU or an
    unknown GPU give ``gpu_flops_available`` to get it.
    """

    def __init__(self, window_size: int = 100, gpu_flops_available: float | None = None) -> None:
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        self._window: deque[tuple[float, int, int, float]] = deque(maxlen=window_size)
        self._last = 0.0
        self._start = 0.0
        self._peak: float | None = None

    def on_fit_start(self, state: Any) -> None:
        self._last = self._start = time.perf_counter()
        self._peak = self.gpu_flops_available
        if self._peak is None and state.device.type == "cuda":
            self._peak = peak_flops(torch.cuda.get_device_name(state.device), state.precision)
        counter = getattr(state.raw_model, "flops_per_batch", None)
        self._flops = counter if callable(counter) else None

    def on_batch_end(self, state: Any, logger: Any) -> None:
        now = time.perf_counter()
        flops = float(self._flops(state.batch)) if self._flops is not None else 0.0
        self._window.append((now - self._last, state.batch_num_samples, state.batch_num_tokens, flops))
        self._last = now
        seconds = sum(w[0] for w in self._window)
        if seconds <= 0:
            return
        world = state.world_size
        samples = sum(w[1] for w in self._window) / seconds
        metrics = {
            "throughput/batches_per_sec": len(self._window) / seconds,
            "throughput/samples_per_sec": samples,
            "throughput/device/samples_per_sec": samples / world,
            "time/train_sec": now - self._start,
        }
        tokens = sum(w[2] for w in self._window)
        if tokens:
            metrics["throughput/tokens_per_sec"] = tokens / seconds
            metrics["throughput/device/tokens_per_sec"] = tokens / seconds / world
        if flops:
            device_flops = sum(w[3] for w in self._window) / seconds  # flops_per_batch counts this rank's batch
            metrics["throughput/device/flops_per_sec"] = device_flops
            if self._peak:
                metrics["throughput/mfu"] = device_flops / self._peak
        logger.log_metrics(metrics)
