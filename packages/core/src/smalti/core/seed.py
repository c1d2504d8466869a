"""``seed_all``: one seed for every generator a model build or a training step draws from."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch on the CPU and every CUDA device.

    Call it before building a model in Python so its initial weights follow ``seed``; the :class:`Trainer`
    and ``smalti-train`` call it with ``trainer.seed`` before they build anything, so a model built after
    ``seed_all(s)`` has the weights of one built inside a run with ``seed=s``.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy takes 32-bit seeds only
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)  # lazily applied: does not start CUDA when it is not in use
