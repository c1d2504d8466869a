"""Label smoothing for models whose outputs are class logits and whose loss is the mean cross-entropy."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.config.types import ProperFraction
from smalti.core.errors import ConfigError, TrainingError
from smalti.core.plugins import Algorithm


class LabelSmoothing(Algorithm):
    """Trains against targets that put ``1 - smoothing`` on the true class and spread ``smoothing`` evenly.

    For a model whose ``loss`` is the mean cross-entropy of ``outputs`` (logits, classes on the last
    dimension), the smoothed loss is ``(1 - smoothing) * loss + smoothing * mean(-log_softmax(outputs))``,
    the mean over classes and counted positions: exactly ``F.cross_entropy(..., label_smoothing=smoothing)``.
    Positions whose target is ``ignore_index`` are left out when the model tells its targets through an
    optional ``targets(batch)`` method; without it every position counts. The loss is replaced in
    ``on_after_loss``, so the logged ``loss/train/total`` is the smoothed one; evaluation is unchanged.
    A model whose loss is computed without materialising the logits (a fused loss) cannot be smoothed here.
    """

    def __init__(self, smoothing: ProperFraction = 0.1, ignore_index: int = -100) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ConfigError(f"algorithms.label_smoothing.smoothing={smoothing} must be in [0, 1)")
        self.smoothing = float(smoothing)
        self.ignore_index = ignore_index

    def on_after_loss(self, state: Any) -> None:
        if self.smoothing == 0.0:
            return
        logits = state.outputs
        if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
            raise TrainingError(
                f"algorithms.label_smoothing needs the model's outputs to be logits with classes on the last "
                f"dimension; {type(state.raw_model).__name__} returned {type(logits).__name__}"
                + (f" of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else "")
                + "; drop algorithms.label_smoothing or smooth inside the model's loss"
            )
        uniform = -torch.log_softmax(logits.float(), dim=-1).mean(dim=-1)
        targets_of = getattr(state.raw_model, "targets", None)
        if callable(targets_of):
            keep = (targets_of(state.microbatch) != self.ignore_index).reshape(uniform.shape)
            uniform = (uniform * keep).sum() / keep.sum().clamp_min(1)
        else:
            uniform = uniform.mean()
        state.loss = (1.0 - self.smoothing) * state.loss + self.smoothing * uniform.to(state.loss.dtype)
