"""The example language model's metrics, in a module of their own so that importing the example models (which
every test and ``smalti-train model=mlp`` run does) does not import torchmetrics: it is loaded only when a metric
is built, i.e. when a run evaluates.
"""

from torchmetrics import MeanMetric


class LanguageCrossEntropy(MeanMetric):
    """Token-weighted mean cross-entropy of next-byte prediction."""


class TokenAccuracy(MeanMetric):
    """Token-weighted fraction of next bytes predicted exactly."""
