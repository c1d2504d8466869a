"""The parallelism interface and the single-process implementation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from smalti.core import distributed
from smalti.core.errors import ConfigError


class Parallelism:
    """How the model is spread over ranks. Subclasses build a mesh and wrap the model.

    ``dp_rank``/``dp_world_size`` say which share of the data this rank reads.
    """

    name = "base"
    #: Whether ``wrap`` shards parameters over ranks. A model built on the meta device is then allocated
    #: after wrapping (each rank holds only its shards); otherwise before (DDP broadcasts rank 0's weights).
    shards_parameters = False

    def __init__(self, backend: str | None = None, timeout_s: float = 600) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.device_mesh: torch.distributed.device_mesh.DeviceMesh | None = None

    def init_distributed(self) -> None:
        """Start the process group when launched by torchrun with more than one rank."""
        distributed.init_process_group(self.backend, self.timeout_s)

    @property
    def dp_rank(self) -> int:
        return distributed.get_rank()

    @property
    def dp_world_size(self) -> int:
        return distributed.get_world_size()

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        """Return the module the training loop calls. The user's module stays reachable as ``state.raw_model``."""
        raise NotImplementedError

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        """Skip the gradient all-reduce for microbatches before the last one."""
        yield


class SingleDevice(Parallelism):
    """One process, one device; refuses to run under a multi-rank launch (use ``ddp``, ``fsdp`` or ``hsdp``)."""

    name = "single"

    def init_distributed(self) -> None:
        if distributed.env_world_size() > 1:
            raise ConfigError(
                f"parallelism=single was launched with WORLD_SIZE={distributed.env_world_size()}; "
                "choose parallelism=ddp, fsdp or hsdp for several ranks"
            )

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        return model
