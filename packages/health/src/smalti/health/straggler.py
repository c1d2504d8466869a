"""Straggler detector: every ``interval`` batches, compare each rank's compute time with the median's.

Each rank times its forward passes (``before_forward`` to ``after_forward``, every microbatch), which
under DDP or a single device hold no collective, so a rank that waits for a slow peer does not look slow
itself. Every ``interval`` batches the per-rank sums are all-gathered (one small tensor); a rank whose
time is more than ``factor`` times the lower median's is reported with its score (time / median) through
the loggers (``health/straggler/score/rank{r}``, ``health/straggler/max_score``) and a warning naming it.
The first ``warmup_batches`` batches of each process (default: one ``interval``) are not timed: first calls
(allocator, kernel and autograd caches, lazy initialisation) take longer on one rank than another and
would flag a healthy rank in the first window.
Under FSDP forward holds parameter all-gathers, which blur the signal; the score still rises on the slow
rank, only less.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

import torch
import torch.distributed as dist

from smalti.core import Callback
from smalti.core.config.types import Field, NonNegativeInt, PositiveInt
from smalti.core.errors import ConfigError

log = logging.getLogger(__name__)


class StragglerDetector(Callback):
    """Finds ranks slower than their peers by ``factor`` and reports them (it never stops the run)."""

    def __init__(self, interval: PositiveInt = 50, factor: Annotated[float, Field(gt=1)] = 1.5, use_cuda_events: bool = True,
                 warmup_batches: NonNegativeInt | None = None) -> None:
        """``warmup_batches``: batches at the start of each process left out of every window (default ``interval``)."""
        if interval < 1 or factor <= 1:
            raise ConfigError(f"health.straggler: interval={interval} must be >= 1 and factor={factor} > 1")
        if warmup_batches is not None and warmup_batches < 0:
            raise ConfigError(f"health.straggler: warmup_batches={warmup_batches} must be >= 0 (or null: one interval)")
        self.interval = interval
        self.factor = factor
        self.warmup_batches = interval if warmup_batches is None else warmup_batches
        self.use_cuda_events = use_cuda_events
        self._t0 = 0.0
        self._seconds = 0.0
        self._batches = 0
        self._events: list[tuple[Any, Any]] = []
        self._start_event: Any = None
        self.flagged: list[dict[str, float]] = []  # every report, for inspection

    def _cuda(self, state: Any) -> bool:
        return self.use_cuda_events and state.device.type == "cuda"

    def on_before_forward(self, state: Any) -> None:
        """Start this microbatch's forward timer."""
        if self._cuda(state):
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._t0 = time.perf_counter()

    def on_after_forward(self, state: Any) -> None:
        """Stop it (CUDA events are read only at the next gather, so no sync in the step)."""
        if self._batches < self.warmup_batches:
            self._start_event = None
            return
        if self._cuda(state):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start_event, end))
        else:
            self._seconds += time.perf_counter() - self._t0

    def on_batch_end(self, state: Any, logger: Any) -> None:
        """Every ``interval`` batches gather the ranks' times and report the slow ones."""
        self._batches += 1
        timed = self._batches - self.warmup_batches
        if timed <= 0 or timed % self.interval:
            return
        if self._events:
            torch.cuda.synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        times = torch.tensor([self._seconds], dtype=torch.float64, device=state.device)
        self._seconds = 0.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.zeros_like(times) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, times)
            per_rank = [float(t) for t in gathered]
        else:
            per_rank = [float(times)]
        report = score_ranks(per_rank)
        metrics = {f"health/straggler/score/rank{r}": s for r, s in enumerate(report)}
        metrics["health/straggler/max_score"] = max(report)
        slow = {r: s for r, s in enumerate(report) if s > self.factor}
        metrics["health/straggler/count"] = float(len(slow))
        logger.log_metrics(metrics)
        if slow:
            self.flagged.append({f"rank{r}": s for r, s in slow.items()})
            if state.rank == 0:
                log.warning("straggler(s) at batch %d: %s (forward time over the median rank's; factor %.2f)",
                            state.timestamp.batch, ", ".join(f"rank {r} x{s:.2f}" for r, s in slow.items()),
                            self.factor)


def score_ranks(seconds: list[float]) -> list[float]:
    """Each rank's time over the lower median of all ranks' (1.0 = typical; 2.0 = twice as slow)."""
    ordered = sorted(seconds)
    median = ordered[(len(ordered) - 1) // 2]
    if median <= 0:
        return [1.0 for _ in seconds]
    return [s / median for s in seconds]
