"""Parallelism plugins (config group ``parallelism``): ``single``, ``ddp``, ``fsdp`` (FSDP2) and ``hsdp``.

Each builds its device mesh and wraps the model; nothing else in the trainer knows which one is active.
"""

from typing import Any

from smalti.core.parallelism.base import Parallelism, SingleDevice
from smalti.core.parallelism.ddp import DDP

__all__ = ["DDP", "FSDP", "HSDP", "Parallelism", "SingleDevice"]


def __getattr__(name: str) -> Any:
    # FSDP imports torch.distributed.fsdp and torch.distributed.tensor (about 1 s of CPU per process): loaded
    # on first use, so that single-device and DDP runs, and every process that imports the trainer, skip it.
    if name in ("FSDP", "HSDP"):
        from smalti.core.parallelism import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
