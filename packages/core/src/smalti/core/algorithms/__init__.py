"""Algorithms: plugins that change the training state (gradient clipping, EMA of weights)."""

from smalti.core.algorithms.ema import EMA
from smalti.core.algorithms.grad_clip import GradientClipping

__all__ = ["EMA", "GradientClipping"]
