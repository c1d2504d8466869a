"""Random-number generator state of Python, NumPy and torch (CPU and CUDA), saved and restored together."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state_dict() -> dict[str, Any]:
    """This process's generator states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state_dict(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state_dict` returned."""
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(value: Any) -> tuple:
    # Serialisers turn the nested tuples of random.getstate() into lists.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)
