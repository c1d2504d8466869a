"""Fully sharded data parallel with FSDP2 (``fully_shard`` per block), flat or hybrid (HSDP, 2-D mesh)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from smalti.core import distributed
from smalti.core.config.types import IntFromMinusOne, PositiveFloat
from smalti.core.errors import ConfigError
from smalti.core.parallelism.base import Parallelism

#: The dtypes FSDP2 computes (``param_dtype``) and reduces gradients (``reduce_dtype``) in, by config name.
ParamDtype = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks to shard one by one: ``model.fsdp_blocks()`` if the model says, else every ModuleList entry."""
    chooser = getattr(model, "fsdp_blocks", None)
    if callable(chooser):
        return list(chooser())
    units: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(module)
    return units


class FSDP(Parallelism):
    """FSDP2: parameters sharded over the ``dp_shard`` mesh dimension, gathered per block for compute.

    Under gradient accumulation each micro batch's gradients are reduce-scattered at once and summed into the
    sharded gradients (``reduce_every_microbatch=True``, as torchtitan does): no rank ever holds a full
    gradient. ``False`` skips the reduce-scatter for all but the last micro batch
    (``set_requires_gradient_sync(False)``): one reduce-scatter per step, but FSDP2 then keeps every
    parameter's unsharded gradient in ``reduce_dtype`` between micro batches (for an 8B model in fp32, 30 GiB
    per GPU). ``smalti plan`` counts whichever is chosen.
    """

    name = "fsdp"
    shards_parameters = True

    def __init__(
        self,
        backend: str | None = None,
        timeout_s: PositiveFloat = 600,
        reshard_after_forward: bool = True,
        param_dtype: ParamDtype | None = None,
        reduce_dtype: ParamDtype | None = None,
        reduce_every_microbatch: bool = True,
    ) -> None:
        super().__init__(backend, timeout_s)
        self.reshard_after_forward = reshard_after_forward
        self.reduce_every_microbatch = bool(reduce_every_microbatch)
        for key, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value not in _DTYPES:
                raise ConfigError(f"parallelism.{key}={value!r} is not one of float32, bfloat16, float16, null")
        self.mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])

    def build_mesh(self, device: torch.device) -> DeviceMesh:
        return init_device_mesh(device.type, (distributed.get_world_size(),), mesh_dim_names=("dp_shard",))

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        if not distributed.is_initialized():
            distributed.init_process_group(self.backend, self.timeout_s)
        if not distributed.is_initialized():
            return model
        self.device_mesh = self.build_mesh(device)
        for unit in shard_units(model):
            fully_shard(
                unit, mesh=self.device_mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self.mp_policy
            )
        fully_shard(model, mesh=self.device_mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self.mp_policy)
        return model

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled or self.reduce_every_microbatch)
        yield


class HSDP(FSDP):
    """Hybrid sharding: replicate over ``dp_replicate`` groups, shard within each ``dp_shard`` group."""

    name = "hsdp"

    def __init__(self, replicate: IntFromMinusOne = -1, shard: IntFromMinusOne = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replicate = replicate
        self.shard = shard

    def mesh_shape(self, world: int) -> tuple[int, int]:
        """``(replicate, shard)`` with one of them inferred (-1) from the world size."""
        replicate, shard = self.replicate, self.shard
        if replicate == -1 and shard == -1:
            shard = world
            replicate = 1
        elif replicate == -1:
            replicate = world // shard if shard > 0 else 0
        elif shard == -1:
            shard = world // replicate if replicate > 0 else 0
        if replicate * shard != world or replicate < 1:
            raise ConfigError(
                f"parallelism.replicate={self.replicate} x parallelism.shard={self.shard} must equal the world size "
                f"{world}; set one of them to -1 to infer it"
            )
        return replicate, shard

    def build_mesh(self, device: torch.device) -> DeviceMesh:
        shape = self.mesh_shape(distributed.get_world_size())
        return init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))
