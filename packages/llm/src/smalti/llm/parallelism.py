"""Ulysses sequence parallelism with FSDP2, as a smalti parallelism plugin (``parallelism=fsdp_sp``).

The world is a ``(dp, sp)`` mesh: the ``sp`` ranks of one group hold the same samples (the data loader is
split over ``dp`` only, and streaming datasets get ``replication: sp``) and each computes one chunk of every
sequence (:meth:`smalti.llm.LLM.enable_sequence_parallel`). Parameters are sharded by FSDP2 over every rank,
whose gradient averaging over all ``dp * sp`` ranks is what the model's sequence-parallel loss expects.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from smalti.core import distributed
from smalti.core.errors import ConfigError
from smalti.core.parallelism import FSDP


class SequenceParallelFSDP(FSDP):
    """FSDP2 over every rank plus Ulysses sequence parallelism over groups of ``sp`` consecutive ranks.

    Args:
        sp: ranks that split each sequence (must divide the world size; 1 is plain FSDP).
        **kwargs: :class:`smalti.core.parallelism.FSDP`'s (``reshard_after_forward``, ``param_dtype``, ...).
    """

    name = "fsdp_sp"

    def __init__(self, sp: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(sp, int) or sp < 1:
            raise ConfigError(f"parallelism.sp={sp!r} must be a positive number of ranks per sequence")
        self.sp = sp
        #: The ``(dp, sp)`` mesh, built by :meth:`wrap`.
        self.sp_mesh: DeviceMesh | None = None

    def _check_world(self) -> int:
        world = distributed.get_world_size() if distributed.is_initialized() else distributed.env_world_size()
        if world % self.sp:
            raise ConfigError(
                f"parallelism.sp={self.sp} does not divide the world size {world}; launch a multiple of {self.sp} "
                "ranks or change parallelism.sp"
            )
        return world

    @property
    def dp_rank(self) -> int:
        """The data-parallel group this rank reads for: ranks ``sp * i .. sp * i + sp - 1`` read the same data."""
        return distributed.get_rank() // self.sp

    @property
    def dp_world_size(self) -> int:
        """The number of different shares of each global batch: ``world / sp``."""
        return max(1, self._check_world() // self.sp)

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        if not distributed.is_initialized():
            distributed.init_process_group(self.backend, self.timeout_s)
        world = self._check_world()
        if self.sp > 1:  # world % sp == 0 here, so a process group is running
            enable = getattr(model, "enable_sequence_parallel", None)
            if not callable(enable):
                raise ConfigError(
                    f"parallelism.sp={self.sp}: model {type(model).__name__} has no enable_sequence_parallel(group); "
                    "use a smalti-llm model or parallelism.sp=1"
                )
            self.sp_mesh = init_device_mesh(device.type, (world // self.sp, self.sp), mesh_dim_names=("dp", "sp"))
            enable(self.sp_mesh.get_group("sp"))
        return super().wrap(model, device, precision)
