"""Parallelism plugins (config group ``parallelism``): ``single``, ``ddp``, ``fsdp`` (FSDP2) and ``hsdp``.

Each builds its device mesh and wraps the model; nothing else in the trainer knows which one is active.
"""

from smalti.core.parallelism.base import Parallelism, SingleDevice
from smalti.core.parallelism.ddp import DDP
from smalti.core.parallelism.fsdp import FSDP, HSDP

__all__ = ["DDP", "FSDP", "HSDP", "Parallelism", "SingleDevice"]
