"""Gradient clipping by global norm or by value, after gradients are complete and unscaled."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.errors import ConfigError
from smalti.core.plugins import Algorithm


class GradientClipping(Algorithm):
    """Clips gradients in ``on_after_train_batch``; with ``norm`` logs the pre-clip global norm as ``grad_norm``.

    Works with FSDP2 (DTensor gradients): the norm is the global one over all shards.
    """

    def __init__(self, clipping_type: str = "norm", clipping_threshold: float = 1.0) -> None:
        if clipping_type not in ("norm", "value"):
            raise ConfigError(f"algorithms.gradient_clipping.clipping_type={clipping_type!r} must be 'norm' or 'value'")
        if clipping_threshold <= 0:
            raise ConfigError(f"algorithms.gradient_clipping.clipping_threshold={clipping_threshold} must be > 0")
        self.clipping_type = clipping_type
        self.clipping_threshold = clipping_threshold

    def on_after_train_batch(self, state: Any, logger: Any) -> None:
        params = [p for p in state.model.parameters() if p.grad is not None]
        if not params:
            return
        if self.clipping_type == "value":
            torch.nn.utils.clip_grad_value_(params, self.clipping_threshold)
            return
        norm = torch.nn.utils.clip_grad_norm_(params, self.clipping_threshold)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        logger.log_metrics({"grad_norm": float(norm)})
