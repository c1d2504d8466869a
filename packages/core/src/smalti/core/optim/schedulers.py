"""Learning-rate schedules with warmup, as multipliers of the optimizer's base LR.

A schedule is called with the run's :class:`~smalti.core.state.State` and the step index and returns the
multiplier; the trainer drives it through ``torch.optim.lr_scheduler.LambdaLR`` so its position is saved
and restored with the scheduler's state dict. ``t_warmup`` and ``t_max`` take any :class:`Time`
(``"100ba"``, ``"0.05dur"``, ``"1ep"``, ``"2e6tok"``, ``"5000sp"``), with any unit of ``max_duration``; ``t_max``
defaults to the run's ``max_duration``.

How units meet: ``dur`` is a fraction of ``max_duration`` in its own unit (``0.1dur`` of ``1e6tok`` is
``1e5tok``); a zero warmup is zero in any unit; ``ep`` counts batches of the train dataloader (which must
report its length). The warmup ramps in its own unit: in ``ba`` the multiplier at step ``s`` is
``(s + 1) / (warmup + 1)``; in ``tok`` or ``sp`` it is ``(seen + per_batch) / (warmup + per_batch)`` with the
tokens (samples) seen before the step and in one batch, which is ``0`` for the very first step (the size of
a batch is not known before the first batch arrives). The decay is counted in batches: ``tok`` and ``sp`` are
converted with the size of the current batch, known from the first batch on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from smalti.core.config.types import Probability, TimeStr
from smalti.core.errors import ConfigError, TimeError
from smalti.core.time import Time, TimeUnit

if TYPE_CHECKING:
    from smalti.core.state import State


class Schedule:
    """Linear warmup from 0 over ``t_warmup``, then :meth:`decay` over the rest of ``t_max``."""

    def __init__(self, t_warmup: TimeStr | Time = "0ba", t_max: TimeStr | Time | None = None, alpha_f: Probability = 0.0) -> None:
        self.t_warmup = Time.from_input(t_warmup)
        self.t_max = Time.from_input(t_max) if t_max is not None else None
        if not 0.0 <= alpha_f <= 1.0:
            raise ConfigError(f"scheduler.alpha_f={alpha_f} must be within [0, 1]")
        self.alpha_f = alpha_f

    def __call__(self, state: State, step: int) -> float:
        warmup = _in_own_unit(self.t_warmup, state, "t_warmup")
        if warmup.value > 0:
            seen = _position(state, step, warmup.unit)
            if seen < warmup.value:
                one = _per_batch(state, warmup.unit)
                return (seen + one) / (warmup.value + one)
        # Past the warmup: a tok/sp warmup > 0 was crossed, so at least one batch told its size.
        warmup_ba = state.to_batches(warmup) if warmup.value > 0 else 0
        if step <= warmup_ba:
            return self.decay(0.0, 0, warmup_ba)  # the start of the decay needs no total (before any batch too)
        total = state.to_batches(_in_own_unit(self.t_max or state.max_duration, state, "t_max"))
        span = max(1, total - warmup_ba)
        frac = min(1.0, (step - warmup_ba) / span)
        return self.decay(frac, step - warmup_ba, warmup_ba)

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


def _in_own_unit(time: Time, state: State, key: str) -> Time:
    """``time`` with ``dur`` turned into ``max_duration``'s unit and ``ep`` into batches; other units unchanged."""
    if time.unit is TimeUnit.DURATION:
        total = state.max_duration
        if total.unit is TimeUnit.DURATION:
            raise TimeError(f"max_duration={total} cannot be in 'dur'; use ep, ba, sp or tok")
        if total.unit is TimeUnit.EPOCH:
            total = Time(state.to_batches(total), TimeUnit.BATCH)
        value = time.value * total.value
        return Time(round(value) if total.unit is TimeUnit.BATCH else math.ceil(value - 1e-9), total.unit)
    if time.unit is TimeUnit.EPOCH:
        try:
            return Time(state.to_batches(time), TimeUnit.BATCH)
        except TimeError:
            raise TimeError(
                f"scheduler.{key}={time} counts epochs, but the train dataloader does not report its length; "
                "give it in ba, sp, tok or dur (a fraction of max_duration)"
            ) from None
    return time


def _position(state: State, step: int, unit: TimeUnit) -> int:
    """How much of ``unit`` was trained before optimizer step ``step``.

    The scheduler asks for the step after the one in progress (``timestamp`` not yet advanced), so the
    current batch's size is added once per step ahead of the timestamp.
    """
    if unit is TimeUnit.BATCH:
        return step
    ahead = step - state.timestamp.batch
    return max(0, state.timestamp.get(unit) + ahead * _per_batch(state, unit))


def _per_batch(state: State, unit: TimeUnit) -> int:
    """One batch in ``unit`` (0 for ``sp``/``tok`` before the first batch told its size)."""
    if unit is TimeUnit.BATCH:
        return 1
    return state.batch_num_samples if unit is TimeUnit.SAMPLE else state.batch_num_tokens
