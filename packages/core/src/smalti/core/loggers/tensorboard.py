"""Writes metrics as TensorBoard scalars (``tensorboard --logdir outputs``), through ``torch.utils.tensorboard``."""

from __future__ import annotations

import json
from typing import Any

from smalti.core import distributed
from smalti.core.errors import ConfigError
from smalti.core.plugins import LoggerDestination


class TensorBoardLogger(LoggerDestination):
    """Event files under ``log_dir`` on rank 0: every logged metric as a scalar at its batch step.

    The hyperparameters are written once as a text summary (``hparams``, JSON; the trainer's logger has
    already redacted credentials). TensorBoard's
    own writer queues events and a background thread writes them, so a step never waits on the disk; they are
    flushed every ``flush_secs`` seconds and when the run closes.

    Args:
        log_dir: the folder of the event files (the CLI uses ``outputs/<run>/tensorboard``).
        flush_secs: how often the writer pushes queued events to the file.
        rank_zero_only: only rank 0 writes (other ranks write ``<log_dir>/rank<N>`` when false).
    """

    def __init__(self, log_dir: str = "tensorboard", flush_secs: float = 10.0, rank_zero_only: bool = True) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError("the TensorBoard logger (logger=tensorboard) needs tensorboard, which is not installed: "
                              "pip install 'smalti-core[tensorboard]'") from None
        self.log_dir = str(log_dir)
        self.flush_secs = flush_secs
        self.rank_zero_only = rank_zero_only
        self._writer: Any = None
        self._closed = False

    def _open(self) -> Any:
        if self._writer is None and not self._closed:
            rank = distributed.get_rank()
            if self.rank_zero_only and rank != 0:
                return None
            from torch.utils.tensorboard import SummaryWriter

            folder = self.log_dir if rank == 0 else f"{self.log_dir}/rank{rank}"
            self._writer = SummaryWriter(log_dir=folder, flush_secs=self.flush_secs)
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        writer = self._open()
        if writer is None:
            return
        for name, value in metrics.items():
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, int | float) or (hasattr(value, "ndim") and getattr(value, "ndim", 1) == 0):
                writer.add_scalar(name, value, global_step=step)

    def log_hyperparameters(self, params: dict[str, Any]) -> None:
        writer = self._open()
        if writer is not None:
            text = json.dumps(params, indent=2, default=str)
            writer.add_text("hparams", f"```\n{text}\n```", global_step=0)

    def flush(self, timeout: float = 30.0) -> bool:
        """Write queued events now (a watchdog about to end the process calls this)."""
        if self._writer is not None:
            self._writer.flush()
        return True

    def on_close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._closed = True
