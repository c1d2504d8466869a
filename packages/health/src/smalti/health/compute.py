"""``smalti-health compute``: a short matmul stress per device, against the device's peak and its peers.

Achieved FLOP/s of repeated square matmuls for about ``seconds``; on a GPU with a known peak (the core's
speed-monitor table) also the fraction of peak. Under a process group every rank's figure is gathered and
a device below ``min_fraction_of_median`` of the median fails: a slow card drags the whole job.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from smalti.health.results import CheckResult, Verdict


def peak_flops_for(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of a GPU named ``device_name`` at ``dtype`` (H100, H200, A100, ...), None if unknown.

    Read from smalti-core's table (the one the speed monitor's MFU uses), so both agree on "peak".
    """
    from smalti.core.callbacks.speed_monitor import peak_flops

    precision = {torch.bfloat16: "amp_bf16", torch.float16: "amp_fp16"}.get(dtype, "fp32")
    return peak_flops(device_name, precision)


def _peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None  # no meaningful peak for a CPU: report achieved FLOP/s only
    return peak_flops_for(torch.cuda.get_device_name(device), dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(device: torch.device, size: int, seconds: float, dtype: torch.dtype) -> float:
    """Achieved FLOP/s of ``size``-square matmuls run back to back for about ``seconds`` (after a warmup)."""
    # A private generator: the check runs mid-training (the MFU alarm) and must not shift the model's stream.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    torch.mm(a, b)
    _sync(device)
    iters, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        iters += 1
        if iters % 4 == 0:
            _sync(device)
            if time.perf_counter() - start >= seconds:
                break
    return 2 * size**3 * iters / (time.perf_counter() - start)


def run_compute_check(
    device: torch.device | str | None = None,
    size: int = 2048,
    seconds: float = 1.0,
    dtype: torch.dtype | None = None,
    min_fraction_of_median: float = 0.8,
    min_fraction_of_peak: float | None = None,
    group: Any = None,
) -> CheckResult:
    """Measure this rank's device; compare with its peak and, under a process group, with every peer.

    All ranks of ``group`` must call it together when a process group is initialised.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    achieved = measure_matmul_flops(device, size, seconds, dtype)
    metrics = {"health/compute/tflops": achieved / 1e12}
    findings: list[tuple[Verdict, str]] = []
    peak = _peak_flops(device, dtype)
    if peak:
        metrics["health/compute/fraction_of_peak"] = achieved / peak
        if min_fraction_of_peak is not None and achieved < min_fraction_of_peak * peak:
            findings.append((Verdict.FAIL, f"{achieved / peak:.0%} of peak, below {min_fraction_of_peak:.0%}"))
    rank = 0
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        rank = dist.get_rank(group)
        gathered: list[float] = [0.0] * dist.get_world_size(group)
        dist.all_gather_object(gathered, achieved, group=group)
        median = sorted(gathered)[len(gathered) // 2]
        metrics["health/compute/fraction_of_median"] = achieved / median
        if achieved < min_fraction_of_median * median:
            findings.append((Verdict.FAIL, f"{achieved / median:.2f} x the median rank's {median / 1e12:.2f} TFLOP/s"))
    verdict = Verdict.FAIL if findings else Verdict.OK
    detail = "; ".join(m for _, m in findings) or "ok"
    return CheckResult(
        f"compute/rank{rank}", verdict,
        f"rank {rank} {device} {dtype}: {achieved / 1e12:.3f} TFLOP/s ({size}x{size} matmul): {detail}", metrics,
    )
