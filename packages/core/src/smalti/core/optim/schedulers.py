"""Learning-rate schedules with warmup, as multipliers of the optimizer's base LR.

A schedule is called with the run's :class:`~smalti.core.state.State` and the step index and returns the
multiplier; the trainer drives it through ``torch.optim.lr_scheduler.LambdaLR`` so its position is saved
and restored with the scheduler's state dict. ``t_warmup`` and ``t_max`` take any :class:`Time`
(``"100ba"``, ``"0.05dur"``, ``"1ep"``); ``t_max`` defaults to the run's ``max_duration``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from smalti.core.errors import ConfigError
from smalti.core.time import Time

if TYPE_CHECKING:
    from smalti.core.state import State


class Schedule:
    """Linear warmup from 0 over ``t_warmup``, then :meth:`decay` over the rest of ``t_max``."""

    def __init__(self, t_warmup: str | Time = "0ba", t_max: str | Time | None = None, alpha_f: float = 0.0) -> None:
        self.t_warmup = Time.from_input(t_warmup)
        self.t_max = Time.from_input(t_max) if t_max is not None else None
        if not 0.0 <= alpha_f <= 1.0:
            raise ConfigError(f"scheduler.alpha_f={alpha_f} must be within [0, 1]")
        self.alpha_f = alpha_f

    def __call__(self, state: State, step: int) -> float:
        warmup = state.to_batches(self.t_warmup)
        if step < warmup:
            return (step + 1) / (warmup + 1)
        total = state.to_batches(self.t_max or state.max_duration)
        span = max(1, total - warmup)
        frac = min(1.0, (step - warmup) / span)
        return self.decay(frac, step - warmup, warmup)

    def decay(self, frac: float, steps_after_warmup: int, warmup: int) -> float:
        """The multiplier after warmup, given the fraction of the decay phase that has passed."""
        raise NotImplementedError


class ConstantWithWarmup(Schedule):
    """Warm up, then hold the base LR."""

    def decay(self, frac: float, steps_after_warmup: int, warmup: int) -> float:
        return 1.0


class LinearWithWarmup(Schedule):
    """Warm up, then fall linearly to ``alpha_f`` times the base LR at ``t_max``."""

    def decay(self, frac: float, steps_after_warmup: int, warmup: int) -> float:
        return 1.0 + (self.alpha_f - 1.0) * frac


class CosineWithWarmup(Schedule):
    """Warm up, then follow half a cosine down to ``alpha_f`` times the base LR at ``t_max``."""

    def decay(self, frac: float, steps_after_warmup: int, warmup: int) -> float:
        return self.alpha_f + (1.0 - self.alpha_f) * 0.5 * (1.0 + math.cos(math.pi * frac))


class InverseSqrtWithWarmup(Schedule):
    """Warm up, then decay as ``sqrt(warmup / step)`` (never below ``alpha_f``)."""

    def decay(self, frac: float, steps_after_warmup: int, warmup: int) -> float:
        scale = max(warmup, 1)
        return max(self.alpha_f, math.sqrt(scale / (scale + steps_after_warmup)))
