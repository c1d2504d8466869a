"""Distributed data parallel: every rank holds the whole model, gradients are averaged by all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from smalti.core import distributed
from smalti.core.config.types import PositiveFloat, PositiveInt
from smalti.core.parallelism.base import Parallelism


class DDP(Parallelism):
    """``torch.nn.parallel.DistributedDataParallel`` over all ranks (a no-op wrapper on one rank)."""

    name = "ddp"

    def __init__(
        self,
        backend: str | None = None,
        timeout_s: PositiveFloat = 600,
        find_unused_parameters: bool = False,
        bucket_cap_mb: PositiveInt = 25,
    ) -> None:
        super().__init__(backend, timeout_s)
        self.find_unused_parameters = find_unused_parameters
        self.bucket_cap_mb = bucket_cap_mb

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        if not distributed.is_initialized():
            return model
        self.device_mesh = init_device_mesh(device.type, (distributed.get_world_size(),), mesh_dim_names=("dp",))
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.bucket_cap_mb,
        )

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        if enabled or not isinstance(model, DistributedDataParallel):
            yield
        else:
            with model.no_sync():
                yield
