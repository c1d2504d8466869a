"""``smalti-health collectives``: collective bandwidth over a sweep of message sizes, and per rank pair.

Bandwidths follow nccl-tests (1 GB = 1e9 bytes): ``algbw = S / t`` and ``busbw = algbw * factor``, where
``S`` is the per-rank buffer each op moves (the full output for all-gather, the full input for
reduce-scatter and all-to-all) and the factor makes busbw comparable with the link's peak at any rank
count: all-reduce ``2(n-1)/n``; all-gather, reduce-scatter, all-to-all ``(n-1)/n``; send/recv 1.
Runs on the current process group (gloo on CPU, NCCL on GPU); a world of one reports zero bus traffic.

The ``min_busbw_gbps`` gate (``--min-busbw``) is judged per op, not per message: small messages are latency
bound and never approach a link's bandwidth, so, like nccl-tests' ``NCCL_TESTS_MIN_BW`` check of its "Avg bus
bandwidth", one ``<op>/gate`` result per op compares the *mean* busbw over the large sizes of the sweep (those
of at least ``gate_min_bytes``, by default 1/16 of the largest size, so the top three sizes of a 4x sweep)
with the threshold. nccl-tests averages every size and fails below 0.9x the value; we average only the large
sizes and fail below the value itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from smalti.health.errors import HealthError
from smalti.health.results import CheckResult, Verdict

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
DEFAULT_SIZES = tuple(1 << p for p in range(10, 25, 2))  # 1 KiB .. 16 MiB
#: Largest message of the default sweep: NCCL links need big messages to reach their bandwidth; gloo on CPU is
#: slow and memory bound, where 16 MiB keeps the sweep short.
DEFAULT_MAX_BYTES = {"nccl": 256 << 20, "gloo": 16 << 20}


def default_max_bytes(group: Any = None) -> int:
    """The default largest message of a sweep on ``group``'s backend (256 MiB on NCCL, 16 MiB otherwise)."""
    backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
    return DEFAULT_MAX_BYTES.get(str(backend), DEFAULT_MAX_BYTES["gloo"])


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor turning algorithm bandwidth into bus bandwidth for ``op`` on ``world_size`` ranks."""
    n = world_size
    if n < 1:
        raise HealthError(f"world_size={n}: must be at least 1")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("send_recv", "broadcast", "reduce"):
        return 1.0
    raise HealthError(f"unknown collective {op!r}; choose from {', '.join(OPS + ('send_recv',))}")


def bandwidths(op: str, size_bytes: int, world_size: int, seconds: float) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s for one op of ``size_bytes`` taking ``seconds``."""
    if seconds <= 0:
        raise HealthError(f"{op}: elapsed time {seconds} s must be positive")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_bandwidth_factor(op, world_size)


def _device(group: Any) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world(group: Any) -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _op_runner(op: str, numel: int, n: int, device: torch.device, dtype: torch.dtype, group: Any):
    """A no-argument callable running ``op`` once on buffers of ``numel`` elements of the timed size."""
    if n == 1 or not dist.is_initialized():
        buf = torch.ones(numel, dtype=dtype, device=device)
        return lambda: buf.clone()
    if op == "all_reduce":
        buf = torch.ones(numel, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    chunk = max(numel // n, 1)
    if op == "all_gather":
        out, inp = torch.empty(chunk * n, dtype=dtype, device=device), torch.ones(chunk, dtype=dtype, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if op == "reduce_scatter":
        inp, out = torch.ones(chunk * n, dtype=dtype, device=device), torch.empty(chunk, dtype=dtype, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    if op == "all_to_all":
        inp, out = torch.ones(chunk * n, dtype=dtype, device=device), torch.empty(chunk * n, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    raise HealthError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(run, iters: int, warmup: int, device: torch.device, group: Any) -> float:
    for _ in range(warmup):
        run()
    _sync(device)
    if dist.is_initialized():
        dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    local = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # nccl-tests reports the slowest rank's time; so do we
        local = local.to(device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return float(local.cpu())


def run_collectives(
    ops: Sequence[str] = ("all_reduce",),
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 5,
    warmup: int = 1,
    group: Any = None,
    min_busbw_gbps: float | None = None,
    dtype: torch.dtype = torch.float32,
    gate_min_bytes: int | None = None,
) -> list[CheckResult]:
    """Time each op at each size on ``group``: one ``ok`` result per (op, size) with its timings.

    With ``min_busbw_gbps``, also one ``<op>/gate`` result per op: ``fail`` when the mean busbw over the sizes
    of at least ``gate_min_bytes`` (default: the largest size / 16) is below it (see the module docstring).
    Every rank must call it with the same arguments (it runs collectives). Sizes are bytes per rank buffer.
    """
    for op in ops:
        bus_bandwidth_factor(op, 1)
    if not sizes_bytes:
        raise HealthError("run_collectives: no message sizes to sweep")
    if gate_min_bytes is not None and gate_min_bytes > max(sizes_bytes):
        raise HealthError(f"gate_min_bytes={gate_min_bytes} is above the largest swept size {max(sizes_bytes)}: "
                          "the gate would have no sizes to judge")
    gate_from = max(sizes_bytes) // 16 if gate_min_bytes is None else gate_min_bytes
    _, n = _world(group)
    device = _device(group)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    results = []
    for op in ops:
        large: list[tuple[int, float]] = []
        for size in sizes_bytes:
            numel = max(int(size) // itemsize, n)
            numel -= numel % n
            nbytes = numel * itemsize
            seconds = _time(_op_runner(op, numel, n, device, dtype, group), iters, warmup, device, group)
            algbw, busbw = bandwidths(op, nbytes, n, seconds)
            if size >= gate_from:
                large.append((nbytes, busbw))
            key = f"health/collectives/{op}/{nbytes}"
            results.append(CheckResult(
                f"{op}/{nbytes}", Verdict.OK,
                f"{op} {nbytes} B on {n} ranks: {seconds * 1e6:.1f} us, algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s",
                {f"{key}/time_us": seconds * 1e6, f"{key}/algbw_gbps": algbw, f"{key}/busbw_gbps": busbw},
            ))
        if min_busbw_gbps is not None and n > 1:
            results.append(_gate(op, large, min_busbw_gbps))
    return results


def _gate(op: str, large: list[tuple[int, float]], min_busbw_gbps: float) -> CheckResult:
    mean = sum(bw for _, bw in large) / len(large)
    sizes = f"{large[0][0]}..{large[-1][0]} B" if len(large) > 1 else f"{large[0][0]} B"
    below = mean < min_busbw_gbps
    return CheckResult(
        f"{op}/gate", Verdict.FAIL if below else Verdict.OK,
        f"{op} mean busbw {mean:.3f} GB/s over {len(large)} size(s) {sizes} "
        + (f"below --min-busbw {min_busbw_gbps:g} GB/s" if below else f"meets --min-busbw {min_busbw_gbps:g} GB/s"),
        {f"health/collectives/{op}/gate_busbw_gbps": mean},
    )


def run_pairwise(size_bytes: int = 1 << 22, iters: int = 5, group: Any = None,
                 min_fraction_of_median: float = 0.5) -> list[CheckResult]:
    """Send/recv bandwidth of every rank pair (both directions timed as one exchange); slow links ``warn``.

    Every rank must call it. Pairs run one at a time so a slow link is not hidden by others' traffic.
    """
    rank, n = _world(group)
    if n < 2:
        return [CheckResult("send_recv", Verdict.OK, "one rank: no links to test", {})]
    device = _device(group)
    numel = max(size_bytes // 4, 1)
    send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)
    timings: dict[tuple[int, int], float] = {}
    for a in range(n):
        for b in range(a + 1, n):
            elapsed = torch.zeros(1, dtype=torch.float64, device=device)
            if rank in (a, b):
                peer = b if rank == a else a
                peer_global = dist.get_global_rank(group, peer) if group is not None else peer
                start = time.perf_counter()
                for _ in range(iters):
                    if rank == a:
                        dist.send(send, peer_global, group=group)
                        dist.recv(recv, peer_global, group=group)
                    else:
                        dist.recv(recv, peer_global, group=group)
                        dist.send(send, peer_global, group=group)
                _sync(device)
                elapsed += (time.perf_counter() - start) / (2 * iters)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            timings[(a, b)] = float(elapsed.cpu())
    busbws = {pair: bandwidths("send_recv", numel * 4, n, t)[1] for pair, t in timings.items()}
    median = sorted(busbws.values())[len(busbws) // 2]
    results = []
    for (a, b), bw in busbws.items():
        slow = bw < min_fraction_of_median * median
        results.append(CheckResult(
            f"send_recv/{a}-{b}", Verdict.WARN if slow else Verdict.OK,
            f"ranks {a}<->{b}: {bw:.3f} GB/s" + (f", below {min_fraction_of_median:g} x median {median:.3f}" if slow else ""),
            {f"health/collectives/send_recv/{a}-{b}/busbw_gbps": bw},
        ))
    return results
