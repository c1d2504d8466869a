"""Language-modelling metrics, weighted by the number of target tokens."""

from __future__ import annotations

import torch
from torchmetrics import MeanMetric


class LanguageCrossEntropy(MeanMetric):
    """Mean next-token cross-entropy (nats) over all target tokens."""


class LanguagePerplexity(MeanMetric):
    """``exp`` of the mean next-token cross-entropy."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


class TokenAccuracy(MeanMetric):
    """Fraction of target tokens predicted exactly by the argmax."""
