"""Logs each optimizer parameter group's learning rate every batch."""

from __future__ import annotations

from typing import Any

from smalti.core.plugins import Callback


class LRMonitor(Callback):
    """Logs ``lr-<OptimizerClass>/group<i>`` for every parameter group of every optimizer at each batch end.

    Two optimizers of the same class are told apart by a suffix: ``lr-AdamW/group0``, ``lr-AdamW-1/group0``.
    """

    def __init__(self) -> None:
        self._names: list[list[str]] = []

    def _keys(self, optimizers: list[Any]) -> list[list[str]]:
        shape = [len(opt.param_groups) for opt in optimizers]
        if [len(names) for names in self._names] != shape:
            seen: dict[str, int] = {}
            self._names = []
            for opt, groups in zip(optimizers, shape):
                name = type(opt).__name__
                count = seen.get(name, 0)
                seen[name] = count + 1
                prefix = f"lr-{name}" if count == 0 else f"lr-{name}-{count}"
                self._names.append([f"{prefix}/group{i}" for i in range(groups)])
        return self._names

    def on_batch_end(self, state: Any, logger: Any) -> None:
        metrics = {}
        for opt, names in zip(state.optimizers, self._keys(state.optimizers)):
            for name, group in zip(names, opt.param_groups):
                metrics[name] = float(group["lr"])
        logger.log_metrics(metrics)
