"""Logs each optimizer parameter group's learning rate every batch."""

from __future__ import annotations

from typing import Any

from smalti.core.plugins import Callback


class LRMonitor(Callback):
    """Logs ``lr-<Optimizer>/group<i>`` at every batch end."""

    def on_batch_end(self, state: Any, logger: Any) -> None:
        metrics = {}
        for opt in state.optimizers:
            for i, group in enumerate(opt.param_groups):
                metrics[f"lr-{type(opt).__name__}/group{i}"] = float(group["lr"])
        logger.log_metrics(metrics)
