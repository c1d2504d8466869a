"""Sends metrics, config and files to Weights & Biases (online or ``WANDB_MODE=offline``), from a background thread."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from smalti.core.errors import ConfigError
from smalti.core.loggers.queued import QueuedLoggerDestination
from smalti.core.redact import redact


class WandBLogger(QueuedLoggerDestination):
    """A W&B run on rank 0; ``wandb.init`` runs on the sender thread so start-up never waits on the network.

    Args:
        project, entity, name, tags: as for ``wandb.init`` (``name`` defaults to the trainer's run name).
        mode: ``online``, ``offline`` or ``disabled``; default ``$WANDB_MODE`` (else wandb's default).
        dir: where wandb writes its run folder (``<dir>/wandb/...``).
        **kwargs: queue settings of :class:`~smalti.core.loggers.queued.QueuedLoggerDestination`.
    """

    def __init__(self, project: str = "smalti", entity: str | None = None, name: str | None = None,
                 mode: str | None = None, dir: str | None = None, tags: list[str] | None = None,
                 flush_interval_s: float = 1.0, **kwargs: Any) -> None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("the W&B logger (logger=wandb) needs wandb, which is not installed: pip install 'smalti-core[wandb]'") from None
        super().__init__(flush_interval_s=flush_interval_s, **kwargs)
        self.project, self.entity, self.name = project, entity, name
        self.mode = mode or os.environ.get("WANDB_MODE")
        self.dir = dir
        self.tags = redact(list(tags or []))  # tags are logged: no URL credentials in them
        self.run: Any = None

    def on_init(self, state: Any) -> None:
        if self.name is None:
            self.name = state.run_name

    def _start(self) -> None:
        import wandb

        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
        with _redacted_argv():  # W&B records the command line, where overrides may carry credentials
            self.run = wandb.init(project=self.project, entity=self.entity, name=self.name, mode=self.mode,
                                  dir=self.dir, tags=self.tags, reinit="create_new")

    def _send(self, items: list[Any]) -> None:
        for item in items:
            if item[0] == "metrics":
                self.run.log(item[2], step=item[1])
            elif item[0] == "params":
                self.run.config.update(item[1], allow_val_change=True)
            elif item[0] == "artifact":
                self.run.save(item[1], base_path=os.path.dirname(os.path.abspath(item[1])), policy="now")

    def _finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)
            self.run = None

    def _is_transient(self, exc: BaseException) -> bool:
        from wandb.errors import CommError

        return isinstance(exc, CommError | OSError)


@contextlib.contextmanager
def _redacted_argv() -> Iterator[None]:
    """``sys.argv`` with credentials redacted while W&B reads it (its run metadata keeps the arguments)."""
    original = list(sys.argv)
    sys.argv[:] = redact(original)
    try:
        yield
    finally:
        sys.argv[:] = original
