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
from smalti.core.config.types import PositiveInt
from smalti.core.errors import ConfigError
from smalti.core.parallelism import FSDP


class SequenceParallelFSDP(FSDP):
    """FSDP2 over every rank plus Ulysses sequence parallelism over groups of ``sp`` consecutive ranks.

    Args:
        sp: ranks that split each sequence (must divide the world size; 1 is plain FSDP).
        **kwargs: :class:`smalti.core.parallelism.FSDP`'s (``reshard_after_forward``, ``param_dtype``, ...).
    """

    name = "fsdp_sp"

    def __init__(self, sp: PositiveInt = 1, **kwargs: Any) -> None:
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


class ExpertParallelFSDP(FSDP):
    """Expert parallelism over groups of ``ep`` consecutive ranks, FSDP2 over the rest (``parallelism=fsdp_ep``).

    As torchtitan does, the expert dimension is borrowed from data parallelism: the world is a
    ``(dp_shard_mod_ep, ep)`` mesh and every rank still reads its own share of the data. Each MoE layer's routed
    experts are split over ``ep`` (:func:`smalti.moe.expert_parallel.shard_experts`: ``num_experts / ep`` per
    rank, tokens sent by all-to-all) and FSDP2-sharded over the ``world / ep`` ranks of ``dp_shard_mod_ep``;
    every other parameter (attention, norms, routers, shared experts) is FSDP2-sharded over all ranks
    (``dp_shard``). Expert gradients are scaled by ``1 / ep`` in the all-to-all's backward, so after FSDP2's
    average over ``dp_shard_mod_ep`` every gradient is that of the mean loss over all ranks.

    Args:
        ep: ranks that split each MoE layer's experts (must divide the world size and every layer's
            ``num_experts``; 1 is plain FSDP2).
        **kwargs: :class:`smalti.core.parallelism.FSDP`'s (``reshard_after_forward``, ``param_dtype``, ...).
    """

    name = "fsdp_ep"

    def __init__(self, ep: PositiveInt = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(ep, int) or ep < 1:
            raise ConfigError(f"parallelism.ep={ep!r} must be a positive number of ranks per expert group")
        self.ep = ep
        #: The ``(dp_shard_mod_ep, ep)`` mesh, built by :meth:`wrap`.
        self.ep_mesh: DeviceMesh | None = None

    def build_mesh(self, device: torch.device) -> DeviceMesh:
        if self.ep_mesh is None:
            return super().build_mesh(device)
        return self.ep_mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")

    def wrap(self, model: nn.Module, device: torch.device, precision: str) -> nn.Module:
        if not distributed.is_initialized():
            distributed.init_process_group(self.backend, self.timeout_s)
        world = distributed.get_world_size() if distributed.is_initialized() else distributed.env_world_size()
        if world % self.ep:
            raise ConfigError(f"parallelism.ep={self.ep} does not divide the world size {world}; launch a multiple "
                              f"of {self.ep} ranks or change parallelism.ep")
        if self.ep > 1:
            from torch.distributed.fsdp import fully_shard

            from smalti.moe import MoE
            from smalti.moe.expert_parallel import shard_experts

            layers = [m for m in model.modules() if isinstance(m, MoE)]
            if not layers:
                raise ConfigError(f"parallelism.ep={self.ep}: model {type(model).__name__} has no MoE layer to split; "
                                  "use an MoE model (ffn_type: moe, or an MoE family with model=hf) or parallelism.ep=1")
            self.ep_mesh = init_device_mesh(device.type, (world // self.ep, self.ep),
                                            mesh_dim_names=("dp_shard_mod_ep", "ep"))
            dp_mesh = self.build_mesh(device)
            options = {"reshard_after_forward": self.reshard_after_forward, "mp_policy": self.mp_policy}
            for layer in layers:
                shard_experts(layer, self.ep_mesh["ep"])
                # The layer's own FSDP unit takes only the experts: its router and shared experts are
                # replicated parameters, sharded over every rank in units of their own first.
                for child in layer.children():
                    if any(True for _ in child.parameters()):
                        fully_shard(child, mesh=dp_mesh, **options)
                fully_shard(layer, mesh=self.ep_mesh["dp_shard_mod_ep"], **options)
        return super().wrap(model, device, precision)
