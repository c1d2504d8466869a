"""Test-only callbacks for the scale-out tests, imported by training workers through ``PYTHONPATH``.

``ParamDigest`` writes every parameter's full value (gathered from FSDP shards) on rank 0 at fit end;
``KillOnce`` kills its own process at a chosen batch on a chosen rank, once per marker file, to fake a lost rank.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from smalti.core import Callback


class ParamDigest(Callback):
    """At fit end, rank 0 writes ``{name: [values...]}`` of the whole (unsharded) model to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_fit_end(self, state, logger) -> None:
        values = {}
        for name, param in sorted(state.model.named_parameters()):
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            values[name] = full.detach().to(torch.float64).flatten().tolist()
        if state.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(values))
            os.replace(tmp, self.path)


class KillOnce(Callback):
    """SIGKILL this worker at the end of batch ``batch`` on global rank ``rank``, unless ``marker`` exists."""

    def __init__(self, marker: str, batch: int, rank: int = 1) -> None:
        self.marker = Path(marker)
        self.batch = batch
        self.rank = rank

    def on_batch_end(self, state, logger) -> None:
        if state.rank == self.rank and state.timestamp.batch == self.batch and not self.marker.exists():
            self.marker.write_text(f"killed rank {self.rank} at batch {self.batch}\n")
            os.kill(os.getpid(), signal.SIGKILL)
