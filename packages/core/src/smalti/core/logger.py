"""The ``logger`` every event hook receives: one call fans out to every logger plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pluggy

    from smalti.core.state import State


class Logger:
    """Front of the logging hooks. ``log_metrics`` stamps the current step; every logger plugin receives it."""

    def __init__(self, hook: pluggy.HookRelay, state: State) -> None:
        self._hook = hook
        self._state = state

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send scalar metrics at ``step`` (default: the current optimizer step) to every logger."""
        if metrics:
            self._hook.log_metrics(metrics=metrics, step=self._state.timestamp.batch if step is None else step)

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        """Send the run's hyperparameters to every logger, with credentials redacted (:mod:`smalti.core.redact`)."""
        from smalti.core.redact import redact

        self._hook.log_hyperparameters(params=redact(params))

    def log_artifact(self, local_path: str, name: str | None = None) -> None:
        """Send a file to every logger that stores artifacts."""
        import os

        self._hook.log_artifact(local_path=str(local_path), name=name or os.path.basename(local_path))
