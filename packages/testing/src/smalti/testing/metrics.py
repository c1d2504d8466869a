"""``MetricsRecorder``: a logger destination that keeps every metric the trainer logs, for assertions."""

from __future__ import annotations

from typing import Any

import pluggy

_hookimpl = pluggy.HookimplMarker("smalti")


class MetricsRecorder:
    """Pass it in the trainer's ``loggers`` and read back what was logged, row by row.

    ``rows`` holds ``(step, metrics)`` in logging order; ``values(key)`` and ``steps(key)`` pick one metric.
    """

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []

    @_hookimpl
    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """The core ``log_metrics`` hook: remember a copy of the row."""
        self.rows.append((step, dict(metrics)))

    def values(self, key: str) -> list[Any]:
        """Every logged value of ``key``, in order."""
        return [m[key] for _, m in self.rows if key in m]

    def steps(self, key: str) -> list[int]:
        """The steps at which ``key`` was logged, in order."""
        return [s for s, m in self.rows if key in m]
