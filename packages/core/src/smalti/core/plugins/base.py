"""Base classes for the plugins a run builds from config: algorithms, callbacks and loggers.

A public method of a subclass whose name starts with ``on_`` or ``should_``, or is a state or logging
hook, is a hook implementation without any marker. Its role sets the order inside an event: algorithms
run first (``tryfirst``), loggers last (``trylast``). A method named like a hook that no spec defines (a
typo such as ``on_bach_end``) makes registration fail with the closest valid name.
"""

from __future__ import annotations

from typing import ClassVar


class SmaltiPlugin:
    """Root of the three roles; ``role_order`` is the pluggy ordering its hooks get by default."""

    role_order: ClassVar[dict[str, bool]] = {}
    #: Hook-method names that are not hooks even though they start with a hook prefix.
    not_hooks: ClassVar[frozenset[str]] = frozenset()


class Algorithm(SmaltiPlugin):
    """A plugin that changes the training state (gradient clipping, EMA, ...). Runs before callbacks."""

    role_order = {"tryfirst": True}


class Callback(SmaltiPlugin):
    """A plugin that observes or steers the run (monitors, guards, early stopping, progress bars)."""


class LoggerDestination(SmaltiPlugin):
    """A plugin that receives ``log_metrics``, ``log_hyperparameters`` and ``log_artifact``. Runs last.

    Subclasses override the logging hooks they support; a logger must never block the training step on
    network I/O (see :class:`smalti.core.loggers.queued.QueuedLoggerDestination`).
    """

    role_order = {"trylast": True}
