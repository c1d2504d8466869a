"""Gradient clipping by global norm or by value, after gradients are complete and unscaled."""

from __future__ import annotations

from typing import Any

import torch

from smalti.core.errors import ConfigError
from smalti.core.plugins import Algorithm


class GradientClipping(Algorithm):
    """Clips gradients in ``on_after_train_batch``, before the optimizer step.

    ``clipping_type="norm"`` scales all gradients together so that their global L2 norm is at most
    ``clipping_threshold`` (``torch.nn.utils.clip_grad_norm_``; with FSDP2's DTensor gradients the norm is
    the one over every shard) and logs the norm before clipping as ``grad_norm``. ``"value"`` clamps each
    gradient element to ``[-clipping_threshold, clipping_threshold]``.

    The norm is read back at ``on_batch_end``, where the trainer already waits for the step, so clipping
    adds no extra host-device synchronisation before the optimizer step.
    """

    def __init__(self, clipping_type: str = "norm", clipping_threshold: float = 1.0) -> None:
        if clipping_type not in ("norm", "value"):
            raise ConfigError(f"algorithms.gradient_clipping.clipping_type={clipping_type!r} must be 'norm' or 'value'")
        if not clipping_threshold > 0:
            raise ConfigError(f"algorithms.gradient_clipping.clipping_threshold={clipping_threshold} must be > 0")
        self.clipping_type = clipping_type
        self.clipping_threshold = float(clipping_threshold)
        self._norm: torch.Tensor | None = None

    def on_after_train_batch(self, state: Any) -> None:
        params = [p for p in state.model.parameters() if p.grad is not None]
        if not params:
            return
        if self.clipping_type == "value":
            torch.nn.utils.clip_grad_value_(params, self.clipping_threshold)
        else:
            self._norm = torch.nn.utils.clip_grad_norm_(params, self.clipping_threshold)

    def on_batch_end(self, logger: Any) -> None:
        if self._norm is None:
            return
        norm, self._norm = self._norm, None
        if hasattr(norm, "full_tensor"):  # DTensor: the reduction over shards is pending
            norm = norm.full_tensor()
        logger.log_metrics({"grad_norm": float(norm)})
