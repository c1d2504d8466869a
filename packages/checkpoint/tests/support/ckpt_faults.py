"""Test-only plugins that smalti-train loads through Hydra (``+callbacks.kill._target_=ckpt_faults.KillAt``).

They live outside ``smalti.*`` and reach the training subprocess through ``PYTHONPATH``.
"""

import os
import signal
import time

from smalti.checkpoint import Checkpointer
from smalti.core import Callback


class KillAt(Callback):
    """SIGKILL this process (rank ``rank``) when batch ``batch`` is about to start: a hard crash, no clean-up."""

    def __init__(self, batch: int, rank: int = 0) -> None:
        self.batch = batch
        self.rank = rank

    def on_batch_start(self, state) -> None:
        if state.timestamp.batch == self.batch and state.rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class SlowCommitCheckpointer(Checkpointer):
    """A Checkpointer whose commit (manifest write) waits ``delay_s`` from batch ``slow_from`` on: a slow store."""

    def __init__(self, *args, delay_s: float = 60.0, slow_from: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s
        self.slow_from = slow_from

    def _commit(self, name, staging, info, gathered):
        if info["timestamp"]["batch"] >= self.slow_from:
            time.sleep(self.delay_s)
        return super()._commit(name, staging, info, gathered)
