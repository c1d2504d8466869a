"""Throughput and model FLOPs utilisation (MFU) over a sliding window of steps."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from smalti.core.config.types import PositiveFloat, PositiveInt
from smalti.core.errors import ConfigError
from smalti.core.plugins import Callback

# Dense peak FLOP/s of one GPU, by precision, from NVIDIA's datasheets. The datasheets print tensor-core
# figures "with sparsity"; the dense figures used here are half of those. ``fp32`` is the CUDA-core rate
# (no tensor cores); ``tf32`` applies to fp32 runs with TF32 matmuls enabled. The A100 has no FP8.
# GH200's GPU has the H100/H200 SXM rates, so its name (which contains "h200") maps to the ``h200`` row.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "a100": {"fp32": 19.5e12, "tf32": 156e12, "amp_bf16": 312e12, "amp_fp16": 312e12},
    "h100-sxm": {"fp32": 67e12, "tf32": 989e12 / 2, "amp_bf16": 1979e12 / 2, "amp_fp16": 1979e12 / 2,
                 "amp_fp8": 3958e12 / 2},
    "h100-pcie": {"fp32": 51e12, "tf32": 756e12 / 2, "amp_bf16": 1513e12 / 2, "amp_fp16": 1513e12 / 2,
                  "amp_fp8": 3026e12 / 2},
    "h100-nvl": {"fp32": 60e12, "tf32": 835e12 / 2, "amp_bf16": 1671e12 / 2, "amp_fp16": 1671e12 / 2,
                 "amp_fp8": 3341e12 / 2},
    "h200": {"fp32": 67e12, "tf32": 989e12 / 2, "amp_bf16": 1979e12 / 2, "amp_fp16": 1979e12 / 2,
             "amp_fp8": 3958e12 / 2},
    "h200-nvl": {"fp32": 60e12, "tf32": 835e12 / 2, "amp_bf16": 1671e12 / 2, "amp_fp16": 1671e12 / 2,
                 "amp_fp8": 3341e12 / 2},
}


def device_key(name: str) -> str | None:
    """Map a CUDA device name (``"NVIDIA H100 80GB HBM3"``) to a row of :data:`PEAK_FLOPS`, or ``None``."""
    name = name.lower()
    for family in ("h200", "h100"):
        if family in name:
            if "nvl" in name:
                return f"{family}-nvl"
            if family == "h100":
                return "h100-pcie" if "pcie" in name else "h100-sxm"
            return family
    return "a100" if "a100" in name else None


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one ``device_name`` GPU at ``precision`` (``fp32``, ``tf32``, ``amp_bf16``, ...)."""
    key = device_key(device_name)
    return PEAK_FLOPS[key].get(precision) if key else None


def matmul_precision(precision: str) -> str:
    """The row to read for a run at ``precision``: ``fp32`` runs whose matmuls use TF32 count at the TF32 rate."""
    if precision != "fp32":
        return precision
    fp32_mode = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if fp32_mode == "tf32" or torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return precision


class SpeedMonitor(Callback):
    """Logs throughput (``throughput/batches_per_sec``, ``samples_per_sec``, ``tokens_per_sec``), the same per
    device under ``throughput/device/``, and ``throughput/mfu``.

    Rates are over the last ``window_size`` batches. Each batch is timed from the request for it to the
    data loader (so data stalls count) to its end; evaluation and checkpointing between batches do not
    count. MFU is ``flops_per_batch(batch)`` (this rank's FLOPs for the step, forward and backward) per
    second over the peak FLOP/s of one device. The peak comes from ``gpu_flops_available`` when given, else
    from :data:`PEAK_FLOPS` by ``torch.cuda.get_device_name`` and the run's precision; on CPU or an unknown
    GPU without ``gpu_flops_available`` MFU is not logged.
    """

    def __init__(self, window_size: PositiveInt = 100, gpu_flops_available: PositiveFloat | None = None) -> None:
        if window_size < 1:
            raise ConfigError(f"callbacks.speed_monitor.window_size={window_size} must be >= 1")
        self.window_size = window_size
        self.gpu_flops_available = float(gpu_flops_available) if gpu_flops_available is not None else None
        # (seconds, samples, tokens, flops) per batch, plus running sums over the window.
        self._window: deque[tuple[float, int, int, float]] = deque()
        self._sums = [0.0, 0, 0, 0.0]
        self._batch_t0: float | None = None
        self._fit_t0 = 0.0
        self._peak: float | None = None
        self._flops: Any = None

    def on_fit_start(self, state: Any) -> None:
        self._fit_t0 = time.perf_counter()
        self._peak = self.gpu_flops_available
        if self._peak is None and state.device.type == "cuda":
            self._peak = peak_flops(torch.cuda.get_device_name(state.device), matmul_precision(state.precision))
        counter = getattr(state.raw_model, "flops_per_batch", None)
        self._flops = counter if callable(counter) else None

    def on_before_dataloader(self) -> None:
        self._batch_t0 = time.perf_counter()

    def on_batch_start(self) -> None:
        if self._batch_t0 is None:  # a loop that feeds batches without asking the data loader hooks
            self._batch_t0 = time.perf_counter()

    def on_batch_end(self, state: Any, logger: Any) -> None:
        now = time.perf_counter()
        seconds = now - (self._batch_t0 if self._batch_t0 is not None else now)
        self._batch_t0 = None
        flops = float(self._flops(state.batch)) if self._flops is not None else 0.0
        samples, tokens = state.batch_num_samples, state.batch_num_tokens
        window = self._window
        window.append((seconds, samples, tokens, flops))
        sums = self._sums
        sums[0] += seconds
        sums[1] += samples
        sums[2] += tokens
        sums[3] += flops
        if len(window) > self.window_size:
            old = window.popleft()
            sums[0] -= old[0]
            sums[1] -= old[1]
            sums[2] -= old[2]
            sums[3] -= old[3]
        window_s, samples, tokens, window_flops = sums
        if window_s <= 0:
            return
        world = state.world_size
        metrics = {
            "throughput/batches_per_sec": len(self._window) / window_s,
            "throughput/samples_per_sec": samples / window_s,
            "throughput/device/batches_per_sec": len(self._window) / window_s,
            "throughput/device/samples_per_sec": samples / window_s / world,
            "time/train_sec": now - self._fit_t0,
        }
        if tokens:
            metrics["throughput/tokens_per_sec"] = tokens / window_s
            metrics["throughput/device/tokens_per_sec"] = tokens / window_s / world
        if window_flops > 0:
            device_flops = window_flops / window_s
            metrics["throughput/device/flops_per_sec"] = device_flops
            metrics["throughput/flops_per_sec"] = device_flops * world
            if self._peak:
                # flops * world / (seconds * world * peak): the world sizes cancel.
                metrics["throughput/mfu"] = device_flops / self._peak
        logger.log_metrics(metrics)
