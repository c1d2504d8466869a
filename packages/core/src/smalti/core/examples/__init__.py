"""Small models and data shipped with core, so the default run trains with no download.

``TinyLM`` is a byte-level causal transformer trained on ``CharCorpus`` (a generated English-like corpus,
see :mod:`smalti.core.examples.make_corpus`); ``MLPRegressor`` on ``SyntheticRegression`` is the fast,
deterministic pair the tests use.
"""

from smalti.core.examples.datasets import CharCorpus, SyntheticRegression
from smalti.core.examples.model import MLPRegressor, TinyLM

__all__ = ["CharCorpus", "MLPRegressor", "SyntheticRegression", "TinyLM"]
