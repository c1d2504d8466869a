"""The ``logger`` every event hook receives: one call fans out to every logger plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smalti.core.dispatch import FastHook

if TYPE_CHECKING:
    import pluggy

    from smalti.core.state import State


class Logger:
    """Front of the logging hooks. ``log_metrics`` stamps the current step; every logger plugin receives it.

    ``latest`` keeps the last value sent of each metric: what :meth:`Trainer.fit` returns as the final metrics.
    """

    def __init__(self, hook: pluggy.HookRelay, state: State) -> None:
        self._hook = hook
        self._state = state
        self._log_metrics: FastHook | None = None
        #: The last value logged of each metric, by name.
        self.latest: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send scalar metrics at ``step`` (default: the current optimizer step) to every logger."""
        if metrics:
            self.latest.update(metrics)
            call = self._log_metrics
            if call is None:
                plugin_manager = self._state.plugin_manager
                if plugin_manager is None or plugin_manager.hook is not self._hook:  # pluggy's own call
                    call = self._hook.log_metrics
                else:
                    call = self._log_metrics = FastHook(plugin_manager, "log_metrics")
            call(metrics=metrics, step=self._state.timestamp.batch if step is None else step)

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        """Send the run's hyperparameters to every logger, with credentials redacted (:mod:`smalti.core.redact`)."""
        from smalti.core.redact import redact

        self._hook.log_hyperparameters(params=redact(params))

    def log_artifact(self, local_path: str, name: str | None = None) -> None:
        """Send a file to every logger that stores artifacts."""
        import os

        self._hook.log_artifact(local_path=str(local_path), name=name or os.path.basename(local_path))
