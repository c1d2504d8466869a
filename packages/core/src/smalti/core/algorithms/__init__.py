"""Algorithms: plugins that change the training state (gradient clipping, EMA and SWA of weights, SAM, ...)."""

from smalti.core.algorithms.ema import EMA
from smalti.core.algorithms.float8 import Float8Training
from smalti.core.algorithms.grad_clip import GradientClipping
from smalti.core.algorithms.label_smoothing import LabelSmoothing
from smalti.core.algorithms.layer_freezing import LayerFreezing
from smalti.core.algorithms.sam import SAM
from smalti.core.algorithms.seq_length_warmup import SeqLengthWarmup
from smalti.core.algorithms.swa import SWA

__all__ = ["EMA", "Float8Training", "GradientClipping", "LabelSmoothing", "LayerFreezing", "SAM", "SWA", "SeqLengthWarmup"]
