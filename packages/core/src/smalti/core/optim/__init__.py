"""Optimizers and learning-rate schedules with warmup in :class:`~smalti.core.time.Time` units."""

from smalti.core.optim.decoupled import DecoupledAdamW, DecoupledSGDW
from smalti.core.optim.in_backward import OptimizerInBackward
from smalti.core.optim.schedulers import (
    ConstantWithWarmup,
    CosineWithWarmup,
    InverseSqrtWithWarmup,
    LinearWithWarmup,
    Schedule,
)

__all__ = [
    "ConstantWithWarmup",
    "CosineWithWarmup",
    "DecoupledAdamW",
    "DecoupledSGDW",
    "InverseSqrtWithWarmup",
    "LinearWithWarmup",
    "OptimizerInBackward",
    "Schedule",
]
